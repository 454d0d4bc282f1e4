"""`llmserve run [MODEL]`: the command line, generated from the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing

from llmserve.config import Config

_ENV_API_KEY = "LLMSERVE_API_KEY"
_ENV_LOG_LEVEL = "LLMSERVE_LOG_LEVEL"


def _base_type(tp):
    """int | None -> int; tuple[str, ...] -> str."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin is tuple:
        return typing.get_args(tp)[0]
    return tp


def _add_section(parser: argparse.ArgumentParser, section: str, cls) -> None:
    group = parser.add_argument_group(section)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        tp = _base_type(hints[f.name])
        dest = f"{section}.{f.name}"
        help_text = meta.get("help", "")
        if meta.get("positional"):
            group.add_argument(dest, nargs="?", default=f.default, metavar=f.name.upper(), help=help_text)
            continue
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:
            on_off = "" if f.default is None else f" (default: {'on' if f.default else 'off'})"
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text + on_off)
        elif meta.get("several"):   # (`--flag a b`, as vLLM's nargs="+", and `--flag a --flag b`)
            group.add_argument(flag, dest=dest, action="extend", nargs="+", type=tp, default=None,
                               metavar=f.name.upper(), help=help_text)
        elif meta.get("append"):
            group.add_argument(flag, dest=dest, action="append", type=tp, default=None,
                               metavar=f.name.upper(), help=help_text)
        else:
            default_text = "" if f.default is None else f" (default: {f.default})"
            group.add_argument(flag, dest=dest, type=tp, default=f.default, metavar=f.name.upper(),
                               help=help_text + default_text)


def build_parser() -> argparse.ArgumentParser:
    from llmserve import __version__

    parser = argparse.ArgumentParser(prog="llmserve", description="OpenAI-compatible LLM server")
    parser.add_argument("--version", action="version", version=f"llmserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # Defaults are written into each flag's help (none for flags without one).
    run = sub.add_parser("run", help="Serve a model over HTTP (OpenAI API).")
    run.set_defaults(run_parser=run)
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        _add_section(run, f.name, hints[f.name])
    return parser


def config_from_args(ns: argparse.Namespace) -> Config:
    values = vars(ns)
    hints = typing.get_type_hints(Config)
    sections = {}
    for f in dataclasses.fields(Config):
        cls = hints[f.name]
        kwargs = {}
        for sf in dataclasses.fields(cls):
            v = values.get(f"{f.name}.{sf.name}", sf.default)
            if sf.metadata.get("append"):
                v = tuple(v) if v else sf.default
            kwargs[sf.name] = v
        sections[f.name] = cls(**kwargs)
    cfg = Config(**sections)
    if cfg.model.model is None:
        for name in cfg.model.served_model_name:
            if name.endswith(".gguf") or os.path.exists(name):
                # `llmserve run --served-model-name a MODEL`: the flag takes several names
                raise ValueError(f"--served-model-name took {name!r}, which names a model file or folder: "
                                 "give the model first (llmserve run MODEL --served-model-name NAME ...)")
    env_keys = os.environ.get(_ENV_API_KEY, "")
    if env_keys and cfg.server.api_key:
        logging.getLogger("llmserve").warning("%s is set, but --api-key is given: only the flag's keys are used",
                                              _ENV_API_KEY)
    elif env_keys:
        keys = tuple(k.strip() for k in env_keys.split(",") if k.strip())
        if not keys:
            # NOTE: an operator who set it asked for keys: serving without any would be open.
            raise ValueError(f"{_ENV_API_KEY} is set but holds no key (keys are comma separated)")
        if len(set(keys)) < len(keys):
            raise ValueError(f"{_ENV_API_KEY} holds a key more than once")
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_key=keys))
    return cfg


def _short_openmp_spin() -> None:
    """Before torch loads: torch's OpenMP workers wait ~10k spins (not libgomp's default
    300k) before sleeping after each parallel op, unless the environment says otherwise.

    NOTE: the Rust kernels (attention, the quantized GEMV) run between torch's ops on their
    own threads, and a worker still spinning holds the core one of them needs. On SmolLM2,
    64 requests x 128 tokens offline on 2 cores went from ~265 to ~300 tok/s, prompts ~9%
    faster, single-stream decode unchanged within noise; 1k spins, 0 and 100k were all
    slower than 10k. Only the CLI sets it: an embedding application owns its process's
    environment (and has usually loaded torch already)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def main(argv: list[str] | None = None) -> int:
    """Exit status: 2 for a bad flag or environment value (before anything binds or loads),
    else what `serve` returns."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = os.environ.get(_ENV_LOG_LEVEL, "INFO").upper()
    if level not in logging.getLevelNamesMapping():
        parser.error(f"{_ENV_LOG_LEVEL} must be one of debug, info, warning, error, critical; got {level!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "run":
        try:
            cfg = config_from_args(args)
        except ValueError as exc:
            # (the run command's usage, as argparse's own errors about its flags)
            args.run_parser.error(str(exc))
        _short_openmp_spin()
        from llmserve.server.app import serve

        return serve(cfg)
    return 2


if __name__ == "__main__":
    sys.exit(main())
