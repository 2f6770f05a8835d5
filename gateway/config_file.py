"""Reading a config file: YAML that refuses a key given twice, and pydantic's errors
spelt as the file spells its keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from policies.registry import controller_kinds


class ConfigError(Exception):
    """A config that cannot be used; the message names the bad key."""


def format_validation_error(error: ValidationError) -> str:
    """One line per error: the key's path as the file spells it, and what was wrong.

    A union (a key, or ``{key, priority}``) reports each of its branches; the branch
    for a scalar says nothing useful about a mapping that was given, so it is left out,
    and pydantic's own names for a branch (``lax-or-strict[...]``, a model's class
    name) are not part of the path."""
    items = error.errors()
    kept = [i for i in items if not (_internal_parts(i["loc"]) and isinstance(i["input"], dict))]
    lines = []
    for item in kept or items:
        parts = _file_path(item["loc"])
        lines.append(f"{'.'.join(parts) or '(top level)'}: {item['msg']}")
    return "\n".join(lines)


def _is_branch_name(part: str | int) -> bool:
    return isinstance(part, str) and ("[" in part or part[:1].isupper())


def _file_path(loc: tuple[str | int, ...]) -> list[str]:
    parts: list[str] = []
    for part in loc:
        # pydantic names a limit block's branch by its tag (`limit.knee.initial`): in
        # the file that is the value of `kind`, not a key.
        is_tag = parts[-1:] == ["limit"] and part in controller_kinds()
        if not (_is_branch_name(part) or is_tag):
            parts.append(str(part))
    return parts


def _internal_parts(loc: tuple[str | int, ...]) -> bool:
    return any(isinstance(part, str) and "[" in part for part in loc)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML keeps the last of a key given twice; in a config that is an editing slip
    (a second `auth:` block silently dropped the first one's keys), so it is refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: keys given beside it override the base's on purpose
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, list | dict):
                continue  # unhashable: the base class reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found the key {key!r} twice",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | Path, *, allow_empty: bool = True) -> dict[str, Any]:
    """The file's top-level mapping. An empty one (nothing, or only comments) sets every
    key to its default; with ``allow_empty=False`` it is refused instead."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): {exc.reason}") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    except RecursionError:  # PyYAML builds nested collections recursively
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    if data is None:
        if not allow_empty:
            raise ConfigError(
                f"{path}: the file is empty (caught while being written?);"
                " to remove every backend, say `backends: []`"
            )
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data
