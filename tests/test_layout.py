"""The shape of the project: the product ships no dev tools, the CLI says how to get them, and no test
module imports another."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import onceflow
from onceflow import cli

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("bench", "chaos", "sim")


def test_the_product_holds_no_dev_tools() -> None:
    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(where=str(ROOT / config["where"][0]), include=tuple(config["include"]))
    assert "onceflow" in packages and "onceflow.testing" in packages
    assert not [p for p in packages if p.split(".")[-1] in TOOLS or p.startswith("onceflow_tools")], packages
    for name in (*TOOLS, "faultproxy.py"):
        assert not (ROOT / "src" / "onceflow" / name).exists(), f"src/onceflow/{name} belongs in tools/onceflow_tools"
    for name in TOOLS:
        assert (ROOT / "tools" / "onceflow_tools" / name / "__init__.py").is_file()


@pytest.mark.parametrize("argv", [["sim", "--seeds", "5"], ["bench", "--help"], ["chaos"]])
def test_a_tool_command_without_the_tools_says_how_to_install_them(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_tools_installed", lambda: False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"onceflow {argv[0]} needs the dev tools" in err
        and "scripts/setup.sh dev" in err
        and "pip install -e tools" in err
    )


def test_the_tool_commands_are_there_with_the_tools() -> None:
    pytest.importorskip("onceflow_tools")
    parser = cli.build_parser()
    for name in TOOLS:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([name, "--help"])
        assert exc.value.code == 0


def test_the_version_is_written_once() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert onceflow.__version__ in (version, "0+unknown")  # from the installed metadata
    assert version not in (ROOT / "src" / "onceflow" / "__init__.py").read_text()


def test_no_test_module_imports_another() -> None:
    # shared helpers live in tests/helpers and fixtures in conftest.py files; a test module that
    # imports another (or a conftest) ties their fates and hides where a helper lives
    import ast

    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top.startswith("test_") or top == "conftest":
                    offenders.append(f"{path.relative_to(ROOT)}: imports {name}")
    assert offenders == [], "import shared helpers from tests/helpers instead:\n" + "\n".join(offenders)
