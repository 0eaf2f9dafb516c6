"""``wsctl completion``: the generated scripts parse, and a real bash completes with them.

Each case sources the script the installed ``wsctl completion bash`` prints into
``bash`` and calls the completion function as bash's own ``complete`` machinery
does (``COMP_WORDS``, ``COMP_CWORD``), reading ``COMPREPLY`` back.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess

import pytest

from wsd_client import wsctl

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    """What the installed ``wsctl completion SHELL`` prints, as ``source <(...)`` reads it."""
    out = {}
    for shell in ("bash", "zsh"):
        done = subprocess.run(["wsctl", "completion", shell], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        out[shell] = done.stdout
    return out


def complete(script: str, line: str) -> list[str]:
    """What bash offers for ``line`` (the cursor at its end; a trailing space starts a new word)."""
    words = shlex.split(line) + ([""] if line.endswith(" ") else [])
    program = (f"{script}\n"
               f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
               "COMPREPLY=(); _wsctl; printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return [w for w in done.stdout.splitlines() if w]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_the_scripts_are_valid_shell(scripts, shell, tmp_path):
    """Fails if a generated script has a syntax error (bash -n; the zsh one is the bash one
    under zsh's bashcompinit, which bash can parse too)."""
    path = tmp_path / f"wsctl.{shell}"
    path.write_text(scripts[shell])
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    assert scripts["zsh"].startswith("#compdef wsctl\n") and "bashcompinit" in scripts["zsh"]


def test_sourcing_registers_the_completion(scripts):
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", scripts["bash"] + "complete -p wsctl"],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "complete -F _wsctl wsctl", done.stderr


@pytest.mark.parametrize("line, offered", [
    ("wsctl st", ["stacks", "stats", "status"]),
    ("wsctl --endpoint tcp://h:1 --timeout 3 st", ["stacks", "stats", "status"]),  # options and their values skipped
    ("wsctl config u", ["use-context"]),
    ("wsctl completion ", ["bash", "zsh"]),
    ("wsctl stats --st", ["--state"]),
    ("wsctl stats --state ", ["missing", "absent", "stale", "locked", "unlocked", "violations"]),
    ("wsctl watch --by", ["--by-group", "--by-slot"]),
    ("wsctl events --f", ["--follow"]),
    ("wsctl pr", ["profiles"]),
    ("wsctl profiles --d", ["--drop"]),
    ("wsctl --vers", ["--version"]),
    ("wsctl lock --group ", []),  # a number to type: nothing to offer
])
def test_bash_completes_commands_options_and_values(scripts, line, offered):
    assert sorted(complete(scripts["bash"], line)) == sorted(offered)  # bash shows them sorted


def test_every_command_and_option_is_completed(scripts):
    """Fails if a command or an option of the parser is missing from the completion (the
    script is generated from the parser: a new one must appear without a change)."""
    parser = wsctl._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert complete(scripts["bash"], "wsctl ") == list(commands)
    for name, sub in commands.items():
        expected = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        assert complete(scripts["bash"], f"wsctl {name} --") == expected, name
