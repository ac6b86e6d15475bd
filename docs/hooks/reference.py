"""The reference pages, generated from the code at every ``mkdocs build`` (an mkdocs hook).

- ``reference/cli.md``: every command and flag, walked from ``kvroute.cli.build_parser()``.
- ``reference/config.md``: every configuration key with its type, default and meaning, walked
  from the ``Config`` schema (msgspec structs); the meaning is the comment on the field in the
  schema's source, else the one beside the key in ``configs/reference.yaml``.
- ``reference/metrics.md``: every ``kvroute_*`` family with its type, labels and help, collected
  from the registries of a router, an endpoint picker and a prefill/decode pair, as they export.

Generated at build time rather than committed, so that nothing is there to go stale or to conflict
when several branches add flags, keys or metrics. ``tests/test_docs.py`` imports this module too: a
flag, key or metric without a description fails it. The site also takes ``BENCHMARKS.md`` from
the repository root as its results page (``benchmarks/results.md``), so that file stays where the
benchmarks append to it.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_YAML = ROOT / "configs" / "reference.yaml"


# ----------------------------------------------------------------------------------------- CLI


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # ("--port",) or ("config",) for a positional
    metavar: str
    help: str
    default: Any
    choices: tuple[str, ...]
    required: bool
    repeat: bool


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("bench", "overhead")
    help: str  # the one line the parent lists
    description: str
    flags: tuple[Flag, ...]
    subcommands: tuple[str, ...]

    @property
    def name(self) -> str:
        return " ".join(("kvroute", *self.path))


def cli_commands(parser: argparse.ArgumentParser | None = None) -> list[Command]:
    """Every command of ``kvroute``, the top level first, then depth first in the parsers'
    order."""
    if parser is None:
        from kvroute.cli import build_parser

        parser = build_parser()
    return list(_walk(parser, (), ""))


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...], help: str) -> Iterator[Command]:
    flags: list[Flag] = []
    children: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                children.append((name, sub, helps.get(name, "")))
            continue
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        flags.append(_flag(action))
    yield Command(
        path=path,
        help=help,
        description=parser.description or "",
        flags=tuple(flags),
        subcommands=tuple(name for name, _, _ in children),
    )
    for name, sub, sub_help in children:
        yield from _walk(sub, (*path, name), sub_help)


def _flag(action: argparse.Action) -> Flag:
    takes_value = action.nargs != 0
    if action.option_strings:
        metavar = ""
        if takes_value:
            metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    else:
        metavar = action.metavar if isinstance(action.metavar, str) else action.dest
    default = action.default
    if default is argparse.SUPPRESS or not takes_value:
        default = None
    return Flag(
        names=tuple(action.option_strings) or (metavar,),
        metavar=metavar,
        help=(action.help or "").strip(),
        default=default,
        choices=tuple(str(c) for c in action.choices) if action.choices else (),
        required=bool(action.required),
        repeat=isinstance(action, argparse._AppendAction),
    )


def cli_markdown(commands: list[Command]) -> str:
    out = [
        "# Command line",
        "",
        "Generated from the command line's own parsers at every build of this site: every "
        "command and flag `kvroute` has, with the help it prints (`kvroute COMMAND --help`). "
        "[Commands at a glance](commands.md) says what each is for.",
        "",
    ]
    for command in commands:
        depth = min(2 + len(command.path), 4)
        if not command.path:
            out += ["## `kvroute`", ""]
        else:
            out += [f"{'#' * depth} `{command.name}`", ""]
        if command.description or command.help:
            out += [_md_text(command.description or command.help), ""]
        if command.subcommands:
            sub = ", ".join(f"`{s}`" for s in command.subcommands)
            out += [f"Commands: {sub}.", ""]
        if command.flags:
            out += ["| flag | default | meaning |", "|---|---|---|"]
            for flag in command.flags:
                out.append(
                    f"| {_flag_cell(flag)} | {_default_cell(flag.default)} | "
                    f"{_cell(_flag_help(flag))} |"
                )
            out.append("")
    return "\n".join(out)


def _flag_cell(flag: Flag) -> str:
    names = ", ".join(f"`{n}`" for n in flag.names)
    if flag.names[0].startswith("-") and flag.metavar:
        names += f" `{flag.metavar}`"
    return names


def _flag_help(flag: Flag) -> str:
    text = flag.help.replace("%(default)s", str(flag.default)).replace("%%", "%")
    extra = []
    if flag.choices and len(", ".join(flag.choices)) < 200:
        extra.append("one of " + ", ".join(f"`{c}`" for c in flag.choices))
    if flag.required:
        extra.append("required")
    if flag.repeat:
        extra.append("repeatable")
    return text + (f" ({'; '.join(extra)})" if extra else "")


def _default_cell(value: Any) -> str:
    if value is None or value == [] or value is False:
        return ""
    return f"`{value}`"


# -------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Key:
    path: str  # "launch.gpus", "replicas[].url", "tenants.by_name.NAME.weight"
    type: str
    default: str
    meaning: str
    section: bool  # a struct of keys of its own


def config_keys() -> list[Key]:
    """Every key of the configuration schema, depth first in the schema's order."""
    from kvroute.router.config import Config

    yaml_notes = reference_yaml_comments()
    return list(_keys(Config, "", yaml_notes))


def _keys(cls: type, prefix: str, yaml_notes: dict[str, str]) -> Iterator[Key]:
    import msgspec

    notes = field_comments(cls)
    for field in msgspec.structs.fields(cls):
        path = f"{prefix}{field.name}"
        inner, shape = _struct_inside(field.type)
        own = notes.get(field.name, "")
        group = own.removeprefix(GROUP) if own.startswith(GROUP) else ""
        meaning = (own if not group else "") or _yaml_note(yaml_notes, path)
        if not meaning and inner is not None:
            meaning = _docstring(inner)  # a section: its class says what it is
        elif not meaning:
            meaning = group
        yield Key(
            path=path,
            type=_type_name(field.type),
            default=_default_text(field),
            meaning=meaning,
            section=inner is not None,
        )
        if inner is not None:
            yield from _keys(inner, f"{path}{shape}.", yaml_notes)


def _struct_inside(kind: Any) -> tuple[type | None, str]:
    """The struct a field holds (itself, optional, in a list or as a dict's values) and how its
    keys' paths continue: "" (a section), "[]" (a list of them), ".NAME" (a map of them)."""
    import msgspec

    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return kind, ""
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            found = _struct_inside(arg)
            if found[0] is not None:
                return found
    if origin is list and args:
        inner, _ = _struct_inside(args[0])
        if inner is not None and not any(_is_plain(a) for a in args):
            return inner, "[]"
    if origin is dict and len(args) == 2:
        inner, _ = _struct_inside(args[1])
        if inner is not None:
            return inner, ".NAME"
    return None, ""


def _is_plain(kind: Any) -> bool:
    return kind in (str, int, float, bool)


def _type_name(kind: Any) -> str:
    import msgspec

    if kind is type(None):
        return "null"
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return "section"
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return f"map[{_type_name(args[0])}, {_type_name(args[1])}]" if args else "map"
    if kind is Any:
        return "any"
    return getattr(kind, "__name__", str(kind))


def _default_text(field: Any) -> str:
    import msgspec

    if field.required:
        return "required"
    if field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, msgspec.Struct):
        return ""  # a section: its keys say
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list) and len(repr(value)) > 60:
        return f"{len(value)} items"
    return str(value) if not isinstance(value, str) else value or '""'


def _docstring(cls: type) -> str:
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")  # its own, not msgspec.Struct's
    return " ".join(doc.split())


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class's source: the one on its line, else the block of comment
    lines right above it (a blank line or code in between breaks the block)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    notes: dict[str, str] = {}
    field_line = re.compile(r"^    (\w+)\s*:")
    group: str | None = None  # the comment block above the run of fields this one continues
    for number, line in enumerate(lines, 1):
        match = field_line.match(line)
        if not match:
            group = None
            continue
        own = comments.get(number)
        if own is not None and not line.lstrip().startswith("#"):
            notes[match.group(1)] = own
            continue
        above: list[str] = []
        at = number - 1
        while at >= 1 and lines[at - 1].lstrip().startswith("#"):
            above.insert(0, comments.get(at, ""))
            at -= 1
        if above:
            group = notes[match.group(1)] = " ".join(above)
        elif group is not None:
            # A comment block above a run of fields speaks for the run (backoff_base_s and
            # backoff_max_s; tls, cert and key), as the schema's comments are written; a
            # comment of the key's own in reference.yaml comes first.
            notes[match.group(1)] = GROUP + group
    return notes


GROUP = "\0group:"  # marks a note a field takes from the comment above its run of fields


def _yaml_note(notes: dict[str, str], path: str) -> str:
    """reference.yaml's comment for a key path: at that path, else (a key of a list entry or a
    named entry, or a section used in two places, such as launch: in pools:) for the same key
    where reference.yaml shows it, its last parts matched."""
    plain = path.replace("[]", "").replace(".NAME", ".*")
    if plain in notes:
        return notes[plain]
    pattern = re.compile(re.escape(plain).replace(r"\*", r"[^.]+") + "$")
    for key, note in notes.items():
        if pattern.match(key):
            return note
    parts = plain.split(".")
    for start in range(1, len(parts) - 1):  # pools.launch.count -> launch.count
        tail = ".".join(parts[start:])
        if "*" not in tail and tail in notes:
            return notes[tail]
    return ""


def reference_yaml_comments(text: str | None = None) -> dict[str, str]:
    """configs/reference.yaml's comment for each key path ("launch.count"): the comment on the
    key's line with its continuation lines, else the comment block right above the key. Keys in
    commented-out sections (``# launch:`` and what follows) count as keys."""
    if text is None:
        text = REFERENCE_YAML.read_text()
    key_re = re.compile(r"^(\s*)(- )?([A-Za-z_][\w-]*):(\s.*)?$")
    notes: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    last_key: str | None = None
    last_col = -1
    for raw in text.splitlines():
        line, commented = raw, False
        stripped = raw.lstrip()
        if stripped.startswith("#"):
            body = stripped[1:]
            if body.startswith(" "):
                body = body[1:]
            if key_re.match(body) and not body.lstrip().startswith("#"):
                line, commented = " " * raw.index("#") + body, True
            else:
                comment = body.lstrip("# ").strip()
                col = raw.index("#")
                if last_key and col >= last_col and not commented:
                    notes[last_key] += " " + comment  # a trailing comment going on
                    continue
                block.append(comment)
                continue
        if not line.strip():
            block, last_key = [], None
            continue
        match = key_re.match(line)
        if not match:
            block, last_key = [], None
            continue
        indent = len(match.group(1)) + (2 if match.group(2) else 0)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if match.group(2):  # "- key:" starts an item: its keys are one level in
            pass
        name = match.group(3)
        path = ".".join([p for _, p in stack] + [name])
        rest = match.group(4) or ""
        trailing = ""
        if " #" in rest or rest.strip().startswith("#"):
            trailing = rest.split("#", 1)[1].strip()
        note = trailing or " ".join(block)
        if note and path not in notes:
            notes[path] = note
            last_key = path if trailing else None
            last_col = raw.index("#", len(raw) - len(rest)) if trailing else -1
        else:
            last_key = None
        block = []
        stack.append((indent, name))
    return notes


def config_markdown(keys: list[Key]) -> str:
    out = [
        "# Configuration",
        "",
        "Generated from the configuration schema (`router/config.py`) at every build of this "
        "site: every key `kvroute serve`, `kvroute epp` and `kvroute check-config` accept, with "
        "its type, its default and what it means (the schema's comment on the key, else "
        "`configs/reference.yaml`'s). A YAML file is validated on load: an unknown key is an "
        "error that names the closest valid one. `configs/reference.yaml` is a working file "
        "with every key at its default.",
        "",
        "`[]` marks a list of entries (`replicas[].url`: the `url` of each entry of "
        "`replicas`), `NAME` a key you choose (`tenants.by_name.NAME.weight`).",
        "",
    ]
    top = [k for k in keys if "." not in k.path and "[]" not in k.path]
    out += ["## Top-level keys", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    out += [_key_row(k) for k in top]
    out.append("")
    for section in top:
        if not section.section:
            continue
        inside = [k for k in keys if _in_section(k.path, section.path)]
        out += [f"## `{section.path}`", ""]
        if section.meaning:
            out += [_md_text(section.meaning), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out += [_key_row(k) for k in inside]
        out.append("")
    out += policy_markdown(policy_params())
    return "\n".join(out)


@dataclass(frozen=True)
class PolicyParam:
    policy: str
    name: str
    type: str
    default: str
    meaning: str


def policy_params() -> list[PolicyParam]:
    """Every policy's ``policy.params``, from its constructor's signature; kv_aware's (the
    default policy's) meanings from configs/reference.yaml, where its parameters are listed."""
    from kvroute.policies.registry import POLICIES

    notes = reference_yaml_comments()
    out = []
    for name, cls in POLICIES.items():
        for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            if param.kind is not param.POSITIONAL_OR_KEYWORD:
                continue
            meaning = notes.get(f"policy.params.{param.name}", "")
            if name != "kv_aware":  # reference.yaml lists kv_aware's; the others' say less
                meaning = OTHER_POLICY_PARAMS.get(param.name, "") or meaning
            default = "null" if param.default is None else str(param.default)
            kind = str(param.annotation).replace("None", "null").replace("float", "number")
            out.append(PolicyParam(name, param.name, kind, default, meaning))
    return out


# What the other policies' parameters mean, as configs/reference.yaml's comment under policy.params
# says ("consistent_hash params: eps, vnodes (as above ...)"; "random and power_of_two params:
# seed ..."): eps and vnodes as kv_aware's, and seed their own.
OTHER_POLICY_PARAMS = {"seed": "Seeds the policy's random draws (null: seeded by the OS)."}


def policy_markdown(params: list[PolicyParam]) -> list[str]:
    from kvroute.policies.registry import POLICIES

    out = [
        "## Policy parameters (`policy.params`)",
        "",
        "`policy.name` picks the policy; `policy.params` (and a pool's `policy.params`) takes its "
        "parameters, checked against the policy's own (an unknown one is a config error). "
        "[How routing works](../routing.md) explains them.",
        "",
    ]
    for name, cls in POLICIES.items():
        doc = inspect.getdoc(sys.modules[cls.__module__]) or ""
        mine = [p for p in params if p.policy == name]
        out += [f"### `{name}`", "", _md_text(doc.split("\n\n")[0]), ""]
        if not mine:
            out += ["No parameters.", ""]
            continue
        out += ["| parameter | type | default | meaning |", "|---|---|---|---|"]
        out += [
            f"| `{p.name}` | {_cell(p.type)} | `{p.default}` | {_cell(p.meaning)} |" for p in mine
        ]
        out.append("")
    return out


def _in_section(path: str, section: str) -> bool:
    return path.startswith((f"{section}.", f"{section}[]."))


def _key_row(key: Key) -> str:
    default = f"`{key.default}`" if key.default else ""
    return f"| `{key.path}` | {_cell(key.type)} | {_cell(default)} | {_cell(key.meaning)} |"


# ------------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Family:
    name: str  # as exported: counters gain _total
    type: str
    labels: tuple[str, ...]
    help: str
    exporters: tuple[str, ...]  # "router", "epp"


def metric_families() -> list[Family]:
    """Every kvroute_* family a router (with a prefill/decode pair) and an endpoint picker
    export, from their registries, without serving anything."""
    return asyncio.run(_collect())


async def _collect() -> list[Family]:
    from prometheus_client import CollectorRegistry

    from kvroute.router.config import config_from_dict
    from kvroute.router.disaggregation import PdMetrics
    from kvroute.router.epp.picker import EndpointPicker
    from kvroute.router.server import Router

    raw = {"replicas": [{"url": "http://127.0.0.1:9"}]}
    found: dict[str, Family] = {}

    def add(metric: Any, labels: tuple[str, ...] | None, exporter: str) -> None:
        name = metric.name + ("_total" if metric.type == "counter" else "")
        if labels is None:
            labels = tuple(
                dict.fromkeys(k for s in metric.samples for k in s.labels if k not in ("le",))
            )
        known = found.get(name)
        exporters = (*known.exporters, exporter) if known else (exporter,)
        found[name] = Family(name, metric.type, labels, " ".join(metric.documentation.split()),
                             tuple(dict.fromkeys(exporters)))  # fmt: skip

    def from_registry(registry: CollectorRegistry, exporter: str) -> None:
        declared: dict[str, tuple[str, ...]] = {}
        for collector in list(registry._collector_to_names):
            names = getattr(collector, "_labelnames", None)
            if names is not None and hasattr(collector, "_name"):
                declared[collector._name] = tuple(names)
        for metric in registry.collect():
            labels = getattr(metric, "_labelnames", None)
            add(metric, tuple(labels) if labels is not None else declared.get(metric.name),
                exporter)  # fmt: skip

    router = Router(config_from_dict(raw))
    from_registry(router.metrics.registry, "router")
    picker = EndpointPicker(config_from_dict({"replicas": raw["replicas"]}))
    from_registry(picker.metrics.registry, "epp")
    for metric in PdMetrics().families([]):  # a router with a prefill/decode pair adds these
        add(metric, tuple(getattr(metric, "_labelnames", ())), "router")
    return sorted((f for f in found.values() if f.name.startswith("kvroute_")),
                  key=lambda f: f.name)  # fmt: skip


def metrics_markdown(families: list[Family]) -> str:
    out = [
        "# Metrics",
        "",
        "Generated from the metric registries of a router and an endpoint picker at every build "
        "of this site: every `kvroute_*` family `GET /metrics` (router) and the picker's "
        "`--metrics-port` export, with its type, labels and help text. Counters are listed by "
        "their exported name (`_total`); histograms also export `_bucket`, `_sum` and `_count`. "
        "[Observability](../observability.md) says how to read them together.",
        "",
        "| family | type | labels | exported by | meaning |",
        "|---|---|---|---|---|",
    ]
    for f in families:
        labels = ", ".join(f"`{label}`" for label in f.labels)
        out.append(
            f"| `{f.name}` | {f.type} | {labels} | {', '.join(f.exporters)} | {_cell(f.help)} |"
        )
    out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------- helpers


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped, < > shown as written."""
    text = " ".join(text.split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _md_text(text: str) -> str:
    return " ".join(text.split()).replace("<", "&lt;").replace(">", "&gt;")


# ---------------------------------------------------------------------------------- mkdocs hook

GENERATED = {
    "reference/cli.md": lambda: cli_markdown(cli_commands()),
    "reference/config.md": lambda: config_markdown(config_keys()),
    "reference/metrics.md": lambda: metrics_markdown(metric_families()),
    "benchmarks/results.md": lambda: (ROOT / "BENCHMARKS.md").read_text(),
    # The READMEs beside the manifests and the dashboard, where a clone has them too.
    "kubernetes-manifests.md": lambda: (ROOT / "deploy" / "kubernetes" / "README.md").read_text(),
    "grafana.md": lambda: (ROOT / "deploy" / "grafana" / "README.md").read_text(),
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    return files
