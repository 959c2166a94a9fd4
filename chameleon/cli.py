"""What the three entry points share: their help, config errors as one line (exit 2), and Hydra.

Before Hydra runs a job (and writes anything into its run directory), the command
line is composed once here: a malformed override, an unknown key (``+train.stpes=2``),
a missing recipe or a config the entry point's own check refuses ends with one line
``chameleon: config error: …`` naming the key and the fix, and exit code 2 (``launch
error`` when this host or its environment cannot run the job as given). Then
Hydra runs the entry point as usual (``--multirun`` sweeps included). ``--help``
prints the entry point's own help; ``--hydra-help`` and Hydra's other flags pass
through.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from chameleon.config import CONF_DIR, RECIPES_DIR, Config, ConfigError, register_configs
from chameleon.model.config import ModelConfig
from chameleon.runtime.protocol.errors import ExitCode, LaunchError

_PASS_THROUGH = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--resolve", "--package", "-p", "--shell-completion",
                 "-sc", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun")


def run(entry: str, usage: str, hydra_main: Callable[[], None], check: Callable[[DictConfig], None]) -> None:
    """Answer ``--help``, refuse a bad command line in one line, then hand over to Hydra.

    Args:
        entry: the module's name (``train``, ``plan``, ``simulate``).
        usage: the entry point's help text.
        hydra_main: the ``@hydra.main`` function.
        check: the entry point's own check of a composed config; raises :class:`ConfigError`.
    """
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        print(usage.strip() + "\n\n" + _groups_help() + "\n\nHydra's own help: --hydra-help")
        sys.exit(0)
    if not any(a.split("=")[0] in _PASS_THROUGH for a in argv):
        try:
            cfg = compose_command_line([a for a in argv if not a.startswith("-")])
            check(cfg)
        except (ConfigError, HydraException, OmegaConfBaseException, ValueError) as err:
            fail(err)
    hydra_main()


def fail(err: BaseException) -> None:
    """Print a config or launch error as one line and exit 2."""
    print(refusal(err), file=sys.stderr, flush=True)
    sys.exit(ExitCode.CONFIG)


def refusal(err: BaseException) -> str:
    """The one line a config error (the command line) or a launch error (this host, its environment) ends with."""
    return f"chameleon: {'launch' if isinstance(err, LaunchError) else 'config'} error: {one_line(err)}"


def one_line(err: BaseException) -> str:
    """``err`` as one line; a value the schema's type refuses names its key and what the type takes."""
    typed = _refused_value(err.__cause__)
    if typed:
        return typed
    text = str(err).split("Config search path")[0]
    return " ".join(part.strip() for part in text.splitlines() if part.strip()) or type(err).__name__


def _refused_value(cause: BaseException | None) -> str | None:
    """``key='value': use one of …`` (an enum), ``key='value': give an integer`` (a number) or ``give true or false``
    (a flag), else None."""
    if not isinstance(cause, ValidationError) or not cause.full_key:
        return None
    choice = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", cause.msg)
    if choice:
        return f"{cause.full_key}={choice[1]!r}: use {choice[2]}"
    number = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", cause.msg)
    if number:
        kind = number[2].lower()
        return f"{cause.full_key}={number[1]!r}: give {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    flag = re.match(r"Value '(.*)' is not a valid bool", cause.msg)
    if flag:
        return f"{cause.full_key}={flag[1]!r}: give true or false"
    return f"{cause.full_key}: {cause.msg.splitlines()[0]}"


def compose_command_line(overrides: list[str]) -> DictConfig:
    """The config the overrides compose to (a sweep's first value stands for all), unknown keys refused.

    Raises:
        ConfigError: an unknown key.
        HydraException, OmegaConfBaseException: what Hydra itself refuses.
    """
    register_configs()
    first = []
    for o in OverridesParser.create().parse_overrides(overrides):
        first.append(f"{o.get_key_element()}={next(o.sweep_string_iterator())}" if o.is_sweep_override() else o.input_line)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=first, return_hydra_config=True)
    _refuse_unknown_keys(cfg)
    return cfg


def _refuse_unknown_keys(cfg: DictConfig) -> None:
    schema = OmegaConf.structured(Config(model=ModelConfig()))
    for key in cfg:
        if key != "hydra":
            _check_known(cfg[key], schema, key, key)


def _check_known(node, schema, key: str, path: str) -> None:
    if key not in schema:
        near = difflib.get_close_matches(key, [str(k) for k in schema], n=1)
        hint = f": did you mean {path.rsplit('.', 1)[0] + '.' if '.' in path else ''}{near[0]}?" if near else ""
        raise ConfigError(f"unknown key {path}{hint} (keys are typed by chameleon/config.py; see --help)")
    sub = schema[key] if OmegaConf.is_dict(schema) else None
    if OmegaConf.is_dict(node) and OmegaConf.is_dict(sub) and OmegaConf.get_type(sub) is not dict:
        for child in node:
            _check_known(node[child], sub, str(child), f"{path}.{child}")


def unwritable(path: Path) -> Path | None:
    """Where ``path`` cannot be created or written: its nearest existing ancestor when that is no writable
    directory; None when it can."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    return None if probe.is_dir() and os.access(probe, os.W_OK | os.X_OK) else probe


def _groups_help() -> str:
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
    lines = ["Config groups (choose with GROUP=OPTION):"]
    for g in groups:
        options = sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml"))
        lines.append(f"  {g}: {', '.join(options)}")
    lines.append(f"Recipes (+recipe=NAME): {', '.join(sorted(p.stem for p in RECIPES_DIR.glob('*.yaml')))}")
    lines.append("Any key can be overridden (train.steps=300); print the whole config with --cfg job.")
    return "\n".join(lines)
