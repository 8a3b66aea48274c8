"""The typed YAML reader: plain YAML values to schema dataclasses, ``_target_`` resolution, YAML files.

* :func:`from_mapping` builds a schema dataclass from a mapping, refusing
  unknown keys and wrong types with their dotted path
  (``dataloader.packing.algo: unknown key``).
* ``_target_`` works the way AutoModel 0.7.0's ``ConfigNode`` resolves it: a
  dotted import path (longest importable module prefix, then attributes),
  called with the node's other keys as keyword arguments, nested ``_target_``
  nodes instantiated first.
* :func:`load_yaml` reads a file with one-line ``file:line:column`` errors.

Knows no schema class: the schema modules build on it.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

#: The YAML section a loader config lives in (AutoModel's recipe key).
LOADER_SECTION = "dataloader"


# --- the typed reader ----------------------------------------------------------------------


def _type_name(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(expected))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(expected))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(expected)[0])}"
    if origin is dict:
        key, item = typing.get_args(expected)
        return f"a mapping of {_type_name(key)} to {_type_name(item)}"
    if dataclasses.is_dataclass(expected):
        return f"a mapping ({expected.__name__})"
    return {type(None): "null", int: "an int", float: "a number", bool: "a bool", str: "a string"}.get(
        expected, str(expected)
    )


#: A number in exponent form without a dot (``2e9``), which PyYAML's YAML 1.1 resolver leaves a string.
_EXPONENT_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)[eE][+-]?\d+$")


def _convert(value: Any, expected: Any, path: str) -> Any:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(expected)
        if value is None and type(None) in options:
            return None
        records = [option for option in options if dataclasses.is_dataclass(option)]
        if isinstance(value, Mapping) and len(records) == 1:  # a mapping can only mean the one record type
            return _convert(value, records[0], path)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, path)
            except (TypeError, ValueError) as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected {_type_name(expected)}")
    if origin is Literal:
        if value not in typing.get_args(expected):
            raise ValueError(f"{path}: got {value!r}, expected {_type_name(expected)}")
        return value
    if origin is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f"{path}: got {type(value).__name__}, expected {_type_name(expected)}")
        key, item = typing.get_args(expected)
        return {_convert(k, key, f"{path}") : _convert(v, item, f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{path}: got {type(value).__name__}, expected {_type_name(expected)}")
        item = typing.get_args(expected)[0]
        return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(expected):
        if isinstance(value, expected):
            return value
        return from_mapping(expected, value, path)
    if expected is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected a bool")
        return value
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected an int")
        return value
    if expected is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.match(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads 2e9 as a string; YAML 1.2 as a number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected a number")
        return float(value)
    if expected is str:
        if not isinstance(value, str):
            raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected a string")
        return value
    raise TypeError(f"{path}: unsupported schema type {expected!r}")  # pragma: no cover - schema bug


def closest_match(name: str, known: Any) -> str:
    """``" (did you mean 'shuffle'?)"`` for the known key closest to a misspelled one, or ``""``."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def from_mapping(cls: type, data: Any, path: str = "dataloader") -> Any:
    """Build a schema dataclass from a mapping, refusing unknown keys and wrong types.

    Args:
        cls: A dataclass of this module.
        data: The parsed YAML mapping.
        path: Dotted location of ``data`` in the YAML, used in error messages.

    Raises:
        TypeError: ``data`` not a mapping, or a value of the wrong type.
        ValueError: Unknown or missing keys, or values out of range.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{path}: got {type(data).__name__}, expected a mapping ({cls.__name__})")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}.{unknown[0]}: unknown key{closest_match(str(unknown[0]), known)}; expected one of "
                         f"{sorted(known)}")
    kwargs = {}
    for name, spec in known.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{path}.{name}")
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ValueError(f"{path}.{name}: missing; expected {_type_name(hints[name])}")
    return cls(**kwargs)


# --- _target_ resolution ----------------------------------------------------------------


#: Top-level module names whose objects a ``_target_`` may never reach (the standard library, builtins).
_FORBIDDEN_TOPS = frozenset(sys.stdlib_module_names) | {"builtins", "__builtin__"}
#: This package's command line: its entry points parse the process's arguments and exit it.
_CLI_PACKAGE = "zephon_loader.cli"
_TRUST = ("a YAML _target_ is imported and called: a configuration is as trusted as a script, and this one would "
          "run the standard library's code")


def _refuse_name(dotted_path: str, where: str) -> None:
    """Refuse, before anything is imported, a dotted path that names the standard library or builtins at its top,
    or a module's ``__main__`` (importing ``pkg.__main__`` runs that program)."""
    parts = dotted_path.split(".")
    if parts[0] in _FORBIDDEN_TOPS:
        raise ValueError(f"{where}: got {dotted_path!r}, a standard-library callable; expected a factory from your "
                         f"own code or a package ({_TRUST})")
    if "__main__" in parts[1:]:
        raise ValueError(f"{where}: got {dotted_path!r}, a module's __main__ (importing it runs that program); "
                         "expected a factory from your own code or a package (a class or a function)")


def _module_of(obj: Any) -> str:
    """The module an object comes from: a module's own name, else its (or its type's) ``__module__``."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module = getattr(obj, "__module__", None)
    return module if isinstance(module, str) else type(obj).__module__


def _refuse_object(dotted_path: str, obj: Any, where: str) -> None:
    """Refuse what a resolved ``_target_`` is, whatever path reached it: a module, an object of the standard
    library or builtins (``zephon_loader.state.os.system`` is ``os.system``), or this package's command line."""
    module = _module_of(obj)
    seen = f"{where}: got {dotted_path!r}"
    expected = "expected a factory from your own code or a package (a class or a function)"
    if module.split(".")[0] in _FORBIDDEN_TOPS:
        name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
        raise ValueError(f"{seen}, which is the standard library's {module}.{name}; {expected} ({_TRUST})")
    if isinstance(obj, types.ModuleType):
        raise ValueError(f"{seen}, the module {module} (not a callable); {expected}")
    if module == _CLI_PACKAGE or module.startswith(_CLI_PACKAGE + "."):
        raise ValueError(f"{seen}, this package's command line ({module}; it parses the process's arguments and "
                         f"exits); {expected}")


def resolve_target(dotted_path: str, where: str = "_target_") -> Any:
    """Import ``pkg.module.attr`` by the longest importable module prefix (AutoModel's rule); call nothing.

    The path is checked before anything is imported (:func:`_refuse_name`) and the object it reaches before it
    is returned (:func:`_refuse_object`): a ``_target_`` is called by its reader, so it may be neither of the
    standard library nor builtins (by any path: ``torch.os.system`` is ``os.system``), a module, a module's
    ``__main__``, nor this package's command line.

    Args:
        dotted_path: The ``_target_`` value.
        where: Its config key for messages (``dataloader.processor._target_``).

    Raises:
        ImportError: No prefix imports, or an attribute is missing; the message names the path.
        ValueError: A target refused by what it names or is (naming the key, the path and what was expected).
    """
    if not isinstance(dotted_path, str) or not dotted_path:
        raise TypeError(f"{where}: got {dotted_path!r}, expected a dotted import path string")
    _refuse_name(dotted_path, where)
    parts = dotted_path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                raise ImportError(f"{where}: module {module_name!r} has no attribute path {'.'.join(parts[cut:])!r} ({dotted_path})")
            obj = getattr(obj, attribute)
        _refuse_object(dotted_path, obj, where)
        return obj
    raise ImportError(f"{where}: cannot import any module prefix of {dotted_path!r}")


def names_this_package(target: Any) -> bool:
    """Whether a dataloader ``_target_`` names something of this package: the only ones ever imported for a
    dataloader node (checked on the dotted name, before any import)."""
    return isinstance(target, str) and target.startswith("zephon_loader.")


def refuse_standard_library_target(node: Any, where: str) -> None:
    """Refuse, before anything is imported, a ``_target_`` (in ``node`` or nested in it) whose dotted path names
    the standard library or builtins at its top, or a module's ``__main__``.

    A YAML ``_target_`` is imported and called, so a configuration is as trusted
    as a script; a processor factory is the user's code or a package's, and
    ``os.system``, ``subprocess.run`` or ``builtins.eval`` have no business
    there. A path that reaches them through another module (``torch.os.system``)
    is refused by :func:`instantiate` once resolved, before anything is called.

    Raises:
        ValueError: Naming the key, the target and what was expected.
    """
    if isinstance(node, list):
        for index, item in enumerate(node):
            refuse_standard_library_target(item, f"{where}[{index}]")
        return
    if not isinstance(node, Mapping):
        return
    target = node.get("_target_")
    if isinstance(target, str):
        _refuse_name(target, f"{where}._target_")
    for key, value in node.items():
        if key != "_target_":
            refuse_standard_library_target(value, f"{where}.{key}")


def instantiate(node: Any, **overrides: Any) -> Any:
    """Instantiate a YAML node the way AutoModel's ``ConfigNode.instantiate`` does.

    Mappings with ``_target_`` are called with their other keys (nested
    ``_target_`` nodes instantiated first); other values are returned as they
    are. ``overrides`` are merged into the top-level call. Every ``_target_`` of
    the node is resolved and checked (:func:`resolve_target`) before any is called.
    """
    return _instantiate(node, "_target_", overrides)


def instantiate_at(node: Any, where: str) -> Any:
    """:func:`instantiate` with messages naming the node's config key (``dataloader.processor``)."""
    return _instantiate(node, where, {})


def _instantiate(node: Any, where: str, overrides: Mapping[str, Any]) -> Any:
    _resolve_all(node, where)  # every target checked before the first call
    return _call(node, where, overrides)


def _resolve_all(node: Any, where: str) -> None:
    if isinstance(node, list):
        for index, item in enumerate(node):
            _resolve_all(item, f"{where}[{index}]")
    elif isinstance(node, Mapping):
        if "_target_" in node:
            resolve_target(node["_target_"], f"{where}._target_")
        for key, value in node.items():
            if key != "_target_":
                _resolve_all(value, f"{where}.{key}")


def _call(node: Any, where: str, overrides: Mapping[str, Any]) -> Any:
    if isinstance(node, list):
        return [_call(item, f"{where}[{index}]", {}) for index, item in enumerate(node)]
    if not isinstance(node, Mapping):
        return node
    if "_target_" not in node:
        return {key: _call(value, f"{where}.{key}", {}) for key, value in node.items()}
    target = resolve_target(node["_target_"], f"{where}._target_")
    kwargs = {key: _call(value, f"{where}.{key}", {}) for key, value in node.items()
              if key != "_target_" and key not in overrides}
    kwargs.update(overrides)
    return target(**kwargs)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML file into a mapping, with a one-line error for a missing or malformed file.

    Raises:
        FileNotFoundError: No such file.
        ValueError: A YAML syntax error, as ``file:line:column: problem``.
        TypeError: The top level is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config: {path} does not exist; expected a YAML file (the bundled demos: "
                                "pkg://demo.yaml, pkg://image_demo.yaml)")
    with path.open() as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            context = getattr(error, "context", None)
            raise ValueError(
                f"{where}: YAML syntax error: {problem}" + (f" ({context})" if context else "")
                + "; expected valid YAML (check indentation, quotes and ':' after keys)"
            ) from None
    if not isinstance(data, dict):
        raise TypeError(f"config: {path} holds {type(data).__name__}, expected a mapping at the top level")
    return data
