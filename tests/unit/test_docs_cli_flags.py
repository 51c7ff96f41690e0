"""The flags users read about are the flags the commands take, with the defaults the commands use.

docs/agent.md's flag table (and docs/proxy.md's for proxy mode) against the `deviceplane agent` parser, the README's
synopses of `deviceplane plugin files|sim` against theirs, docs/agent.md's `deviceplane status` synopsis and
docs/operator.md's Flags section against theirs: a flag added, renamed or removed, or a default changed, on either side
fails here. Defaults are compared as the docs write them (`1s`, `1ms`, `/var/lib/...`)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from deviceplane.agent.cli import duration
from deviceplane.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def options(*command: str) -> dict[str, argparse.Action]:
    """The long flags of `deviceplane <command>` (help excluded), by name."""
    parser = build_parser(command)
    for word in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return {
        name: action
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
        for name in action.option_strings
        if name.startswith("--")
    }


def written_default(action: argparse.Action) -> str | None:
    """The default as the docs write it; None when there is no value to write (unset, a switch)."""
    value = action.default
    if value is None or isinstance(value, bool) or value == []:
        return None
    if action.type is duration:
        return f"{value * 1000:g}ms" if value < 1 else f"{value:g}s"
    return f"{value:g}" if isinstance(value, float) else str(value)


def section(path: str, heading: str) -> str:
    """The text of a markdown section, from its heading to the next heading of the same or a higher level."""
    text = (REPO / path).read_text()
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n")
    end = re.search(rf"\n#{{1,{len(level)}}} ", text[start + 1 :])
    return text[start : start + 1 + end.start()] if end else text[start:]


def flag_table(path: str, heading: str) -> dict[str, str | None]:
    """`| flag(s) | default(s) | meaning |` rows: each flag with its backquoted default, None where none is quoted."""
    defaults: dict[str, str | None] = {}
    for line in section(path, heading).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--"):
            continue
        flags = FLAG.findall(cells[0])
        quoted = re.findall(r"`([^`]*)`", cells[1])
        for i, flag in enumerate(flags):
            defaults[flag] = quoted[i] if len(quoted) == len(flags) else None
    return defaults


AGENT_TABLE = flag_table("docs/agent.md", "## Flags")


def test_every_agent_flag_is_in_the_table_and_nothing_else() -> None:
    assert set(AGENT_TABLE) == set(options("agent"))


@pytest.mark.parametrize(
    ("doc", "heading"), [("docs/agent.md", "## Flags"), ("docs/proxy.md", "## Running it")], ids=["agent", "proxy"]
)
def test_agent_defaults_are_the_documented_ones(doc: str, heading: str) -> None:
    table = flag_table(doc, heading)
    agent = options("agent")
    assert table, f"no flag table under {heading} in {doc}"
    for flag, documented in table.items():
        default = written_default(agent[flag])
        if default is not None:
            assert documented == default, f"{doc}: {flag} documented as {documented!r}, the agent's default {default!r}"


def synopsis(text: str, command: str) -> str:
    """`deviceplane <command> ...` up to its closing backquote (it may wrap across lines), or a `$ deviceplane
    <command> ...` line of a shell example."""
    match = re.search(rf"`deviceplane {command} ([^`]*)`", text) or re.search(rf"\n\$ deviceplane {command} (.*)", text)
    assert match, f"no synopsis of deviceplane {command}"
    return match.group(1)


def check_synopsis(text: str, documented: str, flags: dict[str, argparse.Action], where: str) -> None:
    """Every flag is in the synopsis or the text around it; `[--flag value]` with a literal value names the default."""
    for flag, action in flags.items():
        named = any(re.search(rf"(?<![\w-]){name}(?![\w-])", text) for name in action.option_strings)
        assert named, f"{where}: {flag} is not documented"
    for flag, value in re.findall(r"\[(--[a-z0-9-]+) ([^\] A-Z][^\] ]*)\]", documented):
        assert flag in flags, f"{where}: {flag} is not a flag"
        assert value == written_default(flags[flag]), f"{where}: {flag} shown as {value}, default {flags[flag].default}"


@pytest.mark.parametrize("plugin", ["files", "sim"])
def test_reference_plugin_synopses(plugin: str) -> None:
    readme = section("README.md", "### Reference plugins")
    check_synopsis(readme, synopsis(readme, f"plugin {plugin}"), options("plugin", plugin), f"plugin {plugin}")


def test_status_synopsis() -> None:
    text = section("docs/agent.md", "## `deviceplane status`")
    flags = options("status")
    check_synopsis(text, synopsis(text, "status"), flags, "status")
    assert f"up to {flags['--max-devices'].default} per resource" in text


def test_operator_flags_and_defaults() -> None:
    text = section("docs/operator.md", "## Flags")
    flags = options("operator")
    check_synopsis(text, synopsis(text, "operator"), flags, "operator")
    for flag, action in flags.items():
        default = written_default(action)
        if default is not None:
            stated = f"{flag}` [{default}" in text or (len(default) > 3 and f"`{default}`" in text)
            assert stated, f"docs/operator.md: {flag}'s default {default} is not stated"


def test_demo_flags_are_in_the_readme() -> None:
    text = section("README.md", "## Two commands")
    for flag in options("demo"):
        assert re.search(rf"`{flag}\b", text), f"README.md (Two commands): deviceplane demo {flag} is not documented"


@pytest.mark.parametrize(
    "command", [("agent",), ("operator",), ("plugin", "sim"), ("plugin", "files"), ("status",)], ids=" ".join
)
def test_help_states_the_default(command: tuple[str, ...]) -> None:
    """`--help` writes each default in brackets at the end, by hand where it is a constant's (`[1s]`, `[128]`)."""
    for flag, action in options(*command).items():
        default = written_default(action)
        stated = re.findall(r"\[([^\]]*)\]", (action.help or "") % {**vars(action), "prog": ""})
        if default is not None and stated:
            assert re.split(r";|: |, | = | \(", stated[-1])[0] == default, f"{flag}: help says [{stated[-1]}]"
