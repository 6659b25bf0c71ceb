"""The configuration module: every environment variable shoal reads is declared there once, the README
lists those a user sets, and a bad value is named with what was expected."""

from __future__ import annotations

import ast
import re
from datetime import timedelta
from pathlib import Path

import pytest

from shoal import config

ROOT = Path(__file__).resolve().parent.parent
DECLARED = {v.name for v in config.VARIABLES}


def test_every_shoal_variable_the_package_names_is_declared_in_config() -> None:
    named = {name for path in (ROOT / "shoal").rglob("*.py")
             for name in re.findall(r"\bSHOAL_[A-Z_]+\b", path.read_text())}
    assert named - DECLARED == set(), f"named in shoal/ but not declared in shoal/config.py: {named - DECLARED}"


def test_only_config_reads_the_environment() -> None:
    """Reading os.environ (get, [], in) is config.py's alone; copying it whole for a child process is not a read."""
    readers = []
    for path in (ROOT / "shoal").rglob("*.py"):
        if path.name == "config.py" and path.parent.name == "shoal":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("get", "__getitem__", "getenv") and (
                    ast.unparse(node.value) == "os.environ" or ast.unparse(node) == "os.getenv"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == [], f"environment read outside shoal/config.py: {readers}"


def test_the_readme_lists_exactly_the_variables_users_set() -> None:
    readme = (ROOT / "README.md").read_text()
    environment = readme[readme.index("Environment (each declared once"):]
    listed = set(re.findall(r"`(SHOAL_[A-Z_]+)`", environment))
    users = {v.name for v in config.VARIABLES if v.user}
    assert listed == users, f"README only: {listed - users}; config only: {users - listed}"


def test_an_unset_or_empty_variable_has_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHOAL_HEAL_TIMEOUT", raising=False)
    assert config.SHOAL_HEAL_TIMEOUT.get() == 10.0
    monkeypatch.setenv("SHOAL_HEAL_TIMEOUT", "")
    assert config.SHOAL_HEAL_TIMEOUT.get() == 10.0
    monkeypatch.setenv("SHOAL_HEAL_TIMEOUT", "2.5")
    assert config.SHOAL_HEAL_TIMEOUT.get() == 2.5


@pytest.mark.parametrize(("variable", "text", "expected"), [
    (config.SHOAL_HEAL_TIMEOUT, "-1", "SHOAL_HEAL_TIMEOUT='-1': expected a positive number of seconds"),
    (config.SHOAL_HEARTBEAT_TIMEOUT, "soon", "SHOAL_HEARTBEAT_TIMEOUT='soon': expected a number of seconds"),
    (config.SHOAL_FLIGHT_RECORDER, "many", "SHOAL_FLIGHT_RECORDER='many': expected a whole number, 0 or more"),
    (config.SHOAL_SHM, "yes", "SHOAL_SHM='yes': expected 1 \\(on\\) or 0 \\(off\\)"),
    (config.SHOAL_STREAMS, "0", "SHOAL_STREAMS='0': expected a whole number from 1 to 8"),
    (config.RANK, "first", "RANK='first': expected a whole number, 0 or more"),
    (config.SHOAL_HOST_ID, "rack/1", "SHOAL_HOST_ID='rack/1': expected a name of at most 64 ASCII letters, "
                                     "digits, '-', '_' or '.'"),
    (config.SHOAL_SOCKET_IFNAME, "eth 1", "SHOAL_SOCKET_IFNAME='eth 1': expected network interfaces' names \\(each "
                                          "at most 15 bytes, no '/', ':' or space\\), as `ip link` lists them, "
                                          "separated by commas"),
    (config.SHOAL_SOCKET_IFNAME, "eth1,", "SHOAL_SOCKET_IFNAME='eth1,': expected network interfaces' names \\(each "
                                          "at most 15 bytes, no '/', ':' or space\\), as `ip link` lists them, "
                                          "separated by commas"),
    (config.SHOAL_SOCKET_IFNAME, "eth1,eth1", "SHOAL_SOCKET_IFNAME='eth1,eth1': expected each interface once"),
    (config.SHOAL_SOCKET_IFNAME, ",".join(f"eth{i}" for i in range(9)),
     "SHOAL_SOCKET_IFNAME='eth0,eth1,eth2,eth3,eth4,eth5,eth6,eth7,eth8': expected at most 8 interfaces \\(a pair "
     "of ranks keeps a connection on each, of at most 8\\)"),
])
def test_a_bad_value_is_named_with_what_was_expected(monkeypatch: pytest.MonkeyPatch, variable: config.Variable,
                                                     text: str, expected: str) -> None:
    monkeypatch.setenv(variable.name, text)
    with pytest.raises(ValueError, match=f"^{expected}$"):
        variable.get()


def test_a_transport_refuses_a_bad_heal_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.comm.transport import Transport

    monkeypatch.setenv("SHOAL_HEAL_TIMEOUT", "0")
    with pytest.raises(ValueError, match="SHOAL_HEAL_TIMEOUT='0': expected a positive number of seconds"):
        Transport(0, 1, secret=b"s", session=b"t", hosts=["127.0.0.1"], stall_timeout=timedelta(seconds=5))


def test_a_transport_refuses_a_bad_host_name_before_any_link_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.comm.transport import Transport

    monkeypatch.setenv("SHOAL_HOST_ID", "h\u00f6st")
    with pytest.raises(ValueError, match="SHOAL_HOST_ID='h\u00f6st': expected a name of at most 64 ASCII"):
        Transport(0, 1, secret=b"s", session=b"t", hosts=["127.0.0.1"], stall_timeout=timedelta(seconds=5))
