"""Text files users write (traces, configuration, task files), read alike: UTF-8, with the byte-order mark
a spreadsheet's "CSV UTF-8" or an editor may put first dropped, and a file that is not UTF-8 named in a
one-line error."""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from typing import Any


class NotText(ValueError):
    """A user's file that is not UTF-8 text."""


def read_text(path: Path, name: str | None = None) -> str:
    """The file's text; NotText naming it (as `name`, else its path) when it is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise NotText(f"{name or path}: not UTF-8 text (byte {err.start}: {err.reason})") from None


def load_yaml(text: str) -> Any:
    """The document as `yaml.safe_load` reads it, except for two YAML 1.1 rules that lose a user's meaning
    silently, each a `yaml.YAMLError` at its line instead: a key given twice in one mapping (PyYAML keeps the
    last, and a trace's second `tasks:` dropped the first's tasks), and a base-60 number (`at: 1:30` is 90,
    which a reader of "1 min 30" or "1 h 30" does not expect, and CSV traces refuse)."""
    import yaml  # here: few commands read YAML, and every command imports this module

    class Strict(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                with suppress(TypeError):  # an unhashable key: PyYAML's own error follows
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} given twice in one mapping", key_node.start_mark
                        )
                    seen.add(key)
            return super().construct_mapping(node, deep)

        def construct_number(self, node: yaml.ScalarNode) -> int | float:
            value = (super().construct_yaml_int if node.tag.endswith(":int") else super().construct_yaml_float)(node)
            if ":" in node.value:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{node.value} is YAML 1.1's base-60 for {value}: write the number, or quote it",
                    node.start_mark,
                )  # fmt: skip
            return value

    for tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
        Strict.add_constructor(tag, Strict.construct_number)
    return yaml.load(text, Loader=Strict)


def yaml_problem(err: Exception) -> str:
    """A YAML error in one line: its line and problem where PyYAML names them."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    return f"line {mark.line + 1}: {problem}" if mark and problem else " ".join(str(err).split())
