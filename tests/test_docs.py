"""The documentation stays in step with the code: man/radixd.1 with the argparse parser,
man/radixd.toml.5 and radixd.toml with radixd/settings.py, and packaging/radixd.service
with what the daemon needs (sd_notify, SIGHUP, the drain timeout)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tomllib
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from radixd.cli import build_parser
from radixd.settings import (
    SECTIONS,
    Settings,
    all_keys,
    default_of,
    live_keys,
    load_settings,
    section_of,
)

ROOT = Path(__file__).resolve().parent.parent
MAN1 = ROOT / "man" / "radixd.1"
MAN5 = ROOT / "man" / "radixd.toml.5"
CONFIG = ROOT / "radixd.toml"
UNIT = ROOT / "packaging" / "radixd.service"

GROFF = shutil.which("groff")
needs_groff = pytest.mark.skipif(
    GROFF is None, reason="groff is not installed (apt-get install groff-base; .ci/run installs it)")


def roff(text: str) -> str:
    """How a command-line word is written in the man source (``-`` as ``\\-``)."""
    return text.replace("-", "\\-")


def unroff(text: str) -> str:
    return text.replace("\\-", "-")


def _field(key: str):
    sec, name = key.rsplit(".", 1)
    return next(f for f in fields(SECTIONS[sec]) if f.name == name)


# ------------------------------------------------------------------------ (a) rendering


@needs_groff
@pytest.mark.parametrize("page", [MAN1, MAN5], ids=lambda p: p.name)
def test_man_page_renders_without_warnings(page: Path):
    r = subprocess.run([GROFF, "-ww", "-man", "-Tutf8", str(page)], capture_output=True,
                       encoding="utf-8", env={**os.environ, "LC_ALL": "C.UTF-8"})
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", f"groff warns about {page.name}:\n{r.stderr}"
    text = re.sub(".\b", "", r.stdout)  # drop the overstrike of bold and underline
    title = page.name.upper().rsplit(".", 1)[0]
    assert text.lstrip().startswith(f"{title}(")
    for heading in ("NAME", "SYNOPSIS", "DESCRIPTION", "SEE ALSO"):
        assert re.search(rf"^{heading}$", text, re.M), f"{page.name} has no {heading} section"


# ------------------------------------------------------------------------ (b) radixd.toml.5

# the tag line of a key's .TP entry:  \fBkey\fR \(em \fItype\fR, default \fBvalue\fR[, \fBlive\fR]
TAG = re.compile(r"\\fB(?P<key>\w+)\\fR \\\(em \\fI(?P<type>[a-z ]+)\\fR, "
                 r"default \\fB(?P<default>.*?)\\fR(?P<live>, \\fBlive\\fR)?")
TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list[str]: "list of strings"}


@dataclass
class Entry:
    type: str
    default: str
    live: bool
    body: str


def man5_entries() -> dict[str, Entry]:
    """``section.key`` -> its entry, from the ``.TP`` entries under each ``.SS [section]``."""
    lines = MAN5.read_text().splitlines()
    entries: dict[str, Entry] = {}
    section = None
    for i, line in enumerate(lines):
        if line.startswith((".SH", ".SS")):
            m = re.fullmatch(r"\.SS \[([\w.]+)\]", line)
            section = m[1] if m else None
        if line != ".TP" or section is None:
            continue
        tag = TAG.fullmatch(lines[i + 1])
        assert tag, f"radixd.toml.5 line {i + 2}: the tag under [{section}] does not read {TAG.pattern}"
        body = []
        for nxt in lines[i + 2:]:
            if nxt.startswith((".TP", ".SS", ".SH")):
                break
            body.append(nxt)
        key = f"{section}.{tag['key']}"
        assert key not in entries, f"radixd.toml.5 documents {key} twice"
        entries[key] = Entry(tag["type"], tag["default"], bool(tag["live"]), "\n".join(body))
    return entries


def test_man5_documents_every_key_and_no_other():
    documented = set(man5_entries())
    keys = set(all_keys())
    assert keys - documented == set(), "keys missing from man/radixd.toml.5"
    assert documented - keys == set(), "man/radixd.toml.5 documents keys settings.py does not have"


@pytest.mark.parametrize("key", all_keys())
def test_man5_type_and_default(key: str):
    entry = man5_entries()[key]
    hint = typing.get_type_hints(SECTIONS[key.rsplit(".", 1)[0]])[key.rsplit(".", 1)[1]]
    assert entry.type == TYPE_NAMES[hint]
    shown = tomllib.loads(f"v = {unroff(entry.default)}")["v"]  # the default as TOML reads it
    default = default_of(*key.rsplit(".", 1))
    assert shown == default and type(shown) is type(default), f"{key}: man page says {shown!r}, code {default!r}"


@pytest.mark.parametrize("key", all_keys())
def test_man5_allowed_values(key: str):
    body = unroff(man5_entries()[key].body)
    meta = _field(key).metadata
    for choice in meta.get("choices") or ():
        assert f'"{choice}"' in body, f"{key}: choice {choice!r} is not listed"
    for bound in (meta.get("min"), meta.get("max")):
        if bound is None:
            continue
        number = str(int(bound)) if float(bound).is_integer() else str(bound)
        assert re.search(rf"(?<![\w.]){re.escape(number)}(?![\w]|\.\d)", body), f"{key}: bound {number} is not given"


def test_man5_marks_exactly_the_live_keys():
    marked = {key for key, e in man5_entries().items() if e.live}
    assert live_keys(), "settings.py has no live keys: this test would check nothing"
    assert marked == set(live_keys())


# ------------------------------------------------------------------------ (b) radixd.toml


def config_comments() -> dict[str, str]:
    """``section.key`` -> the comment lines right above it in radixd.toml."""
    comments: dict[str, str] = {}
    section, block = None, []
    for line in CONFIG.read_text().splitlines():
        line = line.strip()
        if not line:
            block = []
        elif line.startswith("#"):
            block.append(line)
        elif m := re.fullmatch(r"\[([\w.]+)\]", line):
            section, block = m[1], []
        else:
            key = line.split("=", 1)[0].strip()
            comments[f"{section}.{key}"] = "\n".join(block)
            block = []
    return comments


def test_config_file_has_every_key_with_its_default():
    with open(CONFIG, "rb") as fh:
        data = tomllib.load(fh)
    def flat(table: dict, prefix: str) -> dict:  # [cache.host] is table "host" inside [cache]
        out = {}
        for k, v in table.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    present = flat(data, "")
    assert set(present) == set(all_keys())
    defaults = Settings()
    for key in all_keys():
        sec, name = key.rsplit(".", 1)
        value, default = present[key], getattr(section_of(defaults, sec), name)
        assert value == default and type(value) is type(default), f"radixd.toml: {key} = {value!r}, default {default!r}"
    assert load_settings(CONFIG) == Settings(source=str(CONFIG))


def test_every_engine_option_with_a_key_is_in_the_file():
    """An ``EngineConfig`` option that names a file key lands in a section the file has (so
    the checks above cover it), and the engine config the defaults give is the default one."""
    from radixd.core.config import EngineConfig

    engine_keys = {key for key, _, _ in EngineConfig.file_options()}
    assert engine_keys and engine_keys <= set(all_keys())
    assert Settings().engine_config() == EngineConfig()


def test_config_file_marks_exactly_the_live_keys():
    comments = config_comments()
    assert set(comments) == set(all_keys())
    marked = {key for key, text in comments.items() if "(live)" in text}
    assert marked == set(live_keys())


# ------------------------------------------------------------------------ (c) radixd.1


def man1_parts() -> dict[tuple[str, str | None], list[str]]:
    """(section, subsection or None) -> its source lines."""
    parts: dict[tuple[str, str | None], list[str]] = {}
    sh, ss = "", None
    for line in MAN1.read_text().splitlines():
        if line.startswith(".SH "):
            sh, ss = line[4:].strip('"'), None
        elif line.startswith(".SS "):
            ss = unroff(line[4:].strip('"'))
        parts.setdefault((sh, ss), []).append(line)
    return parts


def tp_options(lines: list[str]) -> set[str]:
    """The options named in the tags of the ``.TP`` entries in ``lines``."""
    opts = set()
    for i, line in enumerate(lines[:-1]):
        if line == ".TP":
            opts |= {unroff(o) for o in re.findall(r"(?<![\w\\])\\-(?:\\-)?[A-Za-z]\w*(?:\\-\w+)*", lines[i + 1])}
    return opts


def cli() -> tuple[list[argparse.Action], dict[str, argparse.ArgumentParser]]:
    parser = build_parser()
    top, subs = [], {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
        else:
            top.append(action)
    assert subs, "the parser has no subcommands: this test would check little"
    return top, subs


def test_man1_documents_every_top_level_option():
    top, _ = cli()
    options = {o for a in top for o in a.option_strings}
    assert {"--config", "--version", "-h", "--help"} <= options
    assert tp_options(man1_parts()[("OPTIONS", None)]) == options


def test_man1_documents_every_subcommand():
    _, subs = cli()
    parts = man1_parts()
    documented = {ss for (sh, ss) in parts if sh == "COMMANDS" and ss}
    assert documented == set(subs)
    synopsis = "\n".join(parts[("SYNOPSIS", None)])
    for name in subs:
        assert re.search(rf"(?<![\w\\-]){re.escape(roff(name))}(?![\w\\])", synopsis), f"{name} is not in the SYNOPSIS"


@pytest.mark.parametrize("name", sorted(cli()[1]))
def test_man1_documents_every_subcommand_argument(name: str):
    sub = cli()[1][name]
    lines = man1_parts()[("COMMANDS", name)]
    text = "\n".join(lines)
    options = {o for a in sub._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings}
    assert tp_options(lines) == options, f"{name}: options documented vs. the parser's"
    for action in sub._actions:
        if not action.option_strings:
            word = action.metavar or action.dest.upper()
            assert re.search(rf"\b{re.escape(word)}\b", text), f"{name}: argument {word} is not described"


def test_man1_mentions_signals_environment_and_exit_codes():
    parts = man1_parts()
    signals = "\n".join(parts[("SIGNALS", None)])
    for sig in ("SIGTERM", "SIGINT", "SIGHUP"):
        assert sig in signals
    env = tp_tags(parts[("ENVIRONMENT", None)])
    assert {"RADIXD_CACHE", "NOTIFY_SOCKET", "WATCHDOG_USEC"} <= env
    assert tp_tags(parts[("EXIT STATUS", None)]) == {"0", "1", "2"}


def tp_tags(lines: list[str]) -> set[str]:
    tags = set()
    for i, line in enumerate(lines[:-1]):
        if line == ".TP":
            tags.add(re.sub(r"^\.\w+ ", "", lines[i + 1]).split()[0])
    return tags


def test_man1_lists_the_http_routes():
    from unittest.mock import MagicMock

    from radixd.server.app import build_app

    state = MagicMock()  # build_app only asks the plugins for extra routes
    state.plugins.hook.radixd_routes.return_value = []
    routes = [r.path.replace("{model:path}", "") for r in build_app(state).routes]
    assert routes
    api = "\n".join(man1_parts()[("HTTP API", None)])
    for path in routes:
        assert re.search(rf"{re.escape(path)}(?![\w/])", api), f"route {path} is not in radixd.1"


# ------------------------------------------------------------------------ (d) the unit


def unit() -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            current = sections.setdefault(m[1], {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{line!r} outside a section"
        current.setdefault(key, []).append(value)
    return sections


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert m, f"cannot read the time span {value!r}"
    return float(m[1]) * (60 if m[2] in ("min", "m") else 1)


def test_unit_is_a_notify_service_that_runs_the_daemon():
    svc = unit()["Service"]
    assert svc["Type"] == ["notify"]
    assert svc["NotifyAccess"] == ["main"]
    assert svc["ExecStart"] == ["/usr/local/bin/radixd --config /etc/radixd/radixd.toml"]
    assert svc["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert svc["Restart"] == ["on-failure"]
    assert seconds(svc["WatchdogSec"][-1]) > 0 and Settings().server.watchdog
    assert "RADIXD_CACHE=/var/cache/radixd" in svc["Environment"]
    assert svc["CacheDirectory"] == ["radixd"] and svc["StateDirectory"] == ["radixd"]
    assert "yes" in svc.get("DynamicUser", []) or svc.get("User"), "the service must not run as root"
    assert unit()["Install"]["WantedBy"] == ["multi-user.target"]


def test_unit_stop_timeout_exceeds_the_drain_timeout():
    svc = unit()["Service"]
    assert seconds(svc["TimeoutStopSec"][-1]) > Settings().server.drain_timeout_s + 5


HARDENING = {
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "no",
    "SystemCallArchitectures": "native",
    "SystemCallFilter": "@system-service",
}


@pytest.mark.parametrize("key", HARDENING)
def test_unit_hardening(key: str):
    assert unit()["Service"].get(key, [None])[0] == HARDENING[key]


@pytest.mark.parametrize("key,words", [("MemoryDenyWriteExecute", ("JIT", "triton")),
                                       ("PrivateDevices", ("GPU", "PrivateDevices=no"))])
def test_unit_explains_the_exceptions(key: str, words: tuple[str, ...]):
    lines = UNIT.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{key}="))
    comment = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        comment.append(line)
    text = "\n".join(comment)
    for word in words:
        assert word in text, f"the comment above {key}= should explain it ({word!r})"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_verifies(tmp_path: Path):
    exe = shutil.which("radixd")
    if exe is None:
        pytest.skip("the radixd command is not installed")
    text = UNIT.read_text().replace("/usr/local/bin/radixd", exe)
    if shutil.which("man") is None:
        text = re.sub(r"(?m)^Documentation=.*\n", "", text)
    for page, sec in ((MAN1, "1"), (MAN5, "5")):  # Documentation=man:... looks the pages up
        (tmp_path / "man" / f"man{sec}").mkdir(parents=True, exist_ok=True)
        shutil.copy(page, tmp_path / "man" / f"man{sec}" / page.name)
    (tmp_path / "radixd.service").write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "radixd.service")], capture_output=True,
                       text=True, cwd=tmp_path, env={**os.environ, "MANPATH": str(tmp_path / "man")})
    problems = [line for line in (r.stdout + r.stderr).splitlines() if "radixd.service" in line]
    assert problems == [] and r.returncode == 0, r.stdout + r.stderr
