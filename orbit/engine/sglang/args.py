"""`engine.sglang_args`: SGLang server arguments Orbit does not set itself, passed through as they
are, checked at recipe load against SGLang's own argument parser (`ServerArgs.add_cli_args`), so a
misspelt name or a bad value fails naming the field before anything starts."""

from __future__ import annotations

import argparse
import contextlib
import io

# What Orbit sets from its own fields (engine.*, adapter.*, its shims): passing them again would
# fight it.
ORBITS = {
    "model_path",
    "tokenizer_path",
    "host",
    "port",
    "skip_tokenizer_init",
    "dtype",
    "device",
    "base_gpu_id",
    "tp_size",
    "context_length",
    "max_running_requests",
    "random_seed",
    "enable_lora",
    "max_lora_rank",
    "lora_target_modules",
    "max_loras_per_batch",
    "lora_backend",
    "mem_fraction_static",
    "api_key",
    "sampling_mask_max_tokens",
    "enable_memory_saver",
    "log_level",
    "custom_sigquit_handler",
    "sleep_on_idle",
}


def server_flags(args: dict[str, object]) -> list[str]:
    """`{chunked_prefill_size: 512, disable_radix_cache: true}` as `launch_server` flags."""
    flags: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def check(args: dict[str, object], *, on_cpu: bool) -> list[str]:
    """What is wrong with `engine.sglang_args`, one line per field (nothing: an empty list).
    `on_cpu`: an engine runs on the CPU (SGLang's CPU shims first; never for a GPU's engines, whose
    processes and servers would inherit SGLANG_USE_CPU_ENGINE)."""
    if not args:
        return []
    if on_cpu:
        from orbit.engine.sglang_cpu import prepare_cpu_environment

        prepare_cpu_environment()  # before anything imports sglang
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    known = {a.dest for a in parser._actions}
    problems = []
    for name, value in args.items():
        if name in ORBITS:
            problems.append(
                f"engine.sglang_args.{name}: Orbit sets this one itself (from its engine and "
                "adapter settings); leave it out"
            )
        elif name not in known:
            problems.append(
                f"engine.sglang_args.{name}: not an argument of SGLang's server "
                "(sglang.launch_server --help lists them, with dashes for underscores)"
            )
        else:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    parser.parse_args(["--model-path", "m", *server_flags({name: value})])
                except (argparse.ArgumentError, SystemExit) as e:
                    problems.append(
                        f"engine.sglang_args.{name}: SGLang refuses {value!r} "
                        f"({e or err.getvalue()})"
                    )
    return problems
