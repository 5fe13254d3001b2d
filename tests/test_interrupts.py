"""Ctrl-C the ways Python loses it: wrapped in another error, dropped in a __del__, or marked
unhandled."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orbit.host import interrupts


def test_a_ctrl_c_wrapped_in_a_library_error_is_still_a_ctrl_c():
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as err:
            raise RuntimeError("SchemaError: Error building serializer") from err
    except RuntimeError as wrapped:
        assert interrupts.caused_by_ctrl_c(wrapped)
    assert not interrupts.caused_by_ctrl_c(ValueError("bad"))


def test_a_ctrl_c_python_dropped_in_a_del_is_raised_again():
    previous_hook = sys.unraisablehook
    previous = signal.getsignal(signal.SIGINT)
    try:
        interrupts.catch_ctrl_c()
        interrupts.raise_if_dropped()  # nothing yet

        class Dropper:
            def __del__(self):
                # what the handler does when Ctrl-C lands here
                interrupts._remember(signal.SIGINT, None)

        Dropper()  # Python drops the KeyboardInterrupt ("Exception ignored in ...")
        with pytest.raises(KeyboardInterrupt):
            interrupts.raise_if_dropped()
        interrupts.handled()
        # once handled, never raised again (a later run in this process)
        interrupts.raise_if_dropped()
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
        interrupts.handled()


@pytest.mark.slow
def test_a_run_started_from_python_remembers_ctrl_c_for_its_duration():
    """`train()` called from Python (a test, a notebook) has Python's own handler: for the run,
    Ctrl-C is remembered, so one dropped in a __del__ stops the run at its next step
    (orbit/run/loop.py); the handler before comes back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever ran before here
    try:
        with interrupts.remembered():
            assert signal.getsignal(signal.SIGINT) is interrupts._remember

            class Dropper:
                def __del__(self):
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C lands here; Python drops it

            try:
                Dropper()
                with pytest.raises(KeyboardInterrupt):
                    interrupts.raise_if_dropped()
            finally:
                interrupts.handled()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_handled_ctrl_c_inside_exec_exits_130_under_python_m(tmp_path):
    """CPython 3.11 would kill the process with SIGINT at exit (returncode -2) without the reset."""
    (tmp_path / "ctrlc_in_exec.py").write_text(
        textwrap.dedent("""
        import signal, sys
        from orbit.host import interrupts

        def boom(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, boom)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        try:
            exec("while True: pass")
        except KeyboardInterrupt:
            if sys.argv[1:] == ["handled"]:
                interrupts.handled()
            sys.exit(130)
    """)
    )

    def run(*args):
        env = {**os.environ, "PYTHONPATH": str(Path(interrupts.__file__).parents[1])}
        return subprocess.run(
            [sys.executable, "-m", "ctrlc_in_exec", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            timeout=60,
        ).returncode

    assert run("handled") == 130
    if sys.version_info[:2] == (3, 11):
        assert run() == -2  # the CPython behaviour the reset is for


def test_importing_the_command_line_keeps_the_programs_ctrl_c():
    """Only the `orbit` command exits at once on a Ctrl-C while importing; a program (or a test)
    that imports orbit.cli still gets its KeyboardInterrupt."""
    code = textwrap.dedent("""
        import signal
        import orbit.cli
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            print("caught")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "caught", done.stderr[-2000:]


def test_a_ctrl_c_as_a_command_sets_up_is_reported_not_silent(tmp_path, monkeypatch):
    """A Ctrl-C in the first lines of a command (before its work's own try) is still said in one
    line with exit 130: typer would turn one that reaches it into a silent 130. (A CI run sent
    Ctrl-C 1.5 s after `orbit train` started and got exit 130 with nothing said.)"""
    from typer.testing import CliRunner

    import orbit.cli

    def interrupted() -> Path:
        raise KeyboardInterrupt

    monkeypatch.setattr(orbit.cli.scratch, "claim", interrupted)
    previous = signal.getsignal(signal.SIGINT)
    try:
        done = CliRunner().invoke(orbit.cli.app, ["train", str(tmp_path / "r.yaml"), "--quiet"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert done.exit_code == 130
    said = " ".join(done.output.split())
    assert "interrupted: the run did not start, nothing was trained" in said
