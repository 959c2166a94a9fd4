"""Whether this host can run the job as it is launched: checked before anything starts.

:func:`check_job` resolves the launch keys from the environment, checks the config's semantics
(:func:`chameleon.config.validate`) and then what this host offers: memory, devices, the
data files, the checkpoint to resume from, the launch itself.

Node 0 must own ``launcher.master_addr`` and be able to listen on ``launcher.master_port``
(the c10d store) and ``launcher.control_port`` (the agents' link); every node's
``launcher.node_addr`` must be its own; an agent that has reached the controller must
also reach its store. Each check returns the one line that names the key and the fix,
or None.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from chameleon.config import Backend, ConfigError, Device, check, check_data, model_config, validate
from chameleon.decision.profiler import device_overheads
from chameleon.layout.memory import plan_memory
from chameleon.layout.plan import Plan
from chameleon.model.spec import spec_of
from chameleon.runtime.checkpoint import CheckpointError, whole_checkpoint
from chameleon.runtime.node.launch import launch_problem, resolve
from chameleon.runtime.protocol.errors import LaunchError
from chameleon.runtime.worker.device import device_module
from chameleon.runtime.worker.memory import device_memory_bytes

PROBE_S = 5.0
_CHECKED: dict[str, Plan] = {}  # a config's text → its plan: each config is checked once per process


def check_job(cfg: DictConfig) -> Plan:
    """Resolve ``cfg``'s launch keys (in place) and check the job it describes; its plan.

    Raises:
        ConfigError: naming the offending key and the fix.
    """
    _resolve_launch(cfg)
    text = OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    if text not in _CHECKED:
        _check_devices(cfg.launcher)
        plan = validate(cfg)
        _check_memory(cfg, plan)
        check_data(cfg)
        if cfg.ckpt.resume is not None:
            _check_resume(cfg.ckpt.resume, cfg)
        problem = launch_problem(cfg.launcher)
        check(problem is None, problem or "")
        _CHECKED[text] = plan
    return _CHECKED[text]


def _resolve_launch(cfg: DictConfig) -> None:
    """Fill the launch keys left null from the environment (:mod:`chameleon.runtime.node.launch`)."""
    try:
        resolved = resolve(OmegaConf.to_container(cfg.launcher, resolve=True))
    except LaunchError as err:
        raise ConfigError(str(err)) from None
    for key, value in resolved.items():
        cfg.launcher[key] = value


def _check_memory(cfg: DictConfig, plan: Plan) -> None:
    """Refuse plans whose per-device state cannot fit; say how to shrink."""
    model = model_config(cfg)
    costs = spec_of(model).memory_costs(model, micro_batch=plan.micro_batch_size, seq_len=cfg.train.seq_len,
                                        dtype=cfg.train.dtype, recompute=cfg.train.recompute,
                                        overheads=device_overheads(cfg.cluster))
    need = plan_memory(costs, plan)
    try:
        per_device, total = device_memory_bytes(cfg.launcher)
    except RuntimeError as err:
        raise ConfigError(str(err)) from None
    worst = max(need.values())
    if worst <= per_device and sum(need.values()) <= total:
        return
    gib = 2**30
    raise ConfigError(
        f"model '{cfg.model.name}' needs {worst / gib:.1f} GiB on its busiest device and "
        f"{sum(need.values()) / gib:.1f} GiB over {len(need)} devices, but launcher.device={cfg.launcher.device} "
        f"offers {per_device / gib:.1f} GiB per device and {total / gib:.1f} GiB in all: shrink the model by "
        "override (e.g. model.n_layers=4 model.dim=256 model.n_heads=4 model.n_kv_heads=4 train.seq_len=128), "
        f"{'' if cfg.train.recompute == 'full' else 'keep fewer activations (train.recompute=full), '}"
        "or plan and simulate it instead (python -m chameleon.plan / python -m chameleon.simulate)"
    )


def _check_devices(launcher) -> None:
    """The launch's accelerator is here (before any plan is checked against it); NCCL needs a GPU per worker."""
    if launcher.device == Device.cpu:
        return
    try:
        module = device_module(launcher.device)
    except RuntimeError as err:
        raise ConfigError(str(err)) from None
    if launcher.device == Device.cuda and launcher.backend in (None, Backend.nccl):
        check(launcher.nproc_per_node <= module.device_count(),
              f"NCCL needs a GPU per worker but launcher.nproc_per_node={launcher.nproc_per_node} and "
              f"{module.device_count()} GPU(s) are visible: set launcher.backend=gloo (workers share GPUs) "
              "or fewer workers per node")


def _check_resume(resume: str, cfg: DictConfig) -> None:
    """Refuse a checkpoint root with no whole checkpoint of this model (a damaged newer one is passed over: the
    controller says so when it resumes)."""
    model = model_config(cfg)
    root = Path(resume).expanduser()
    check(root.is_dir(), f"ckpt.resume={resume} is not a directory: give a run's checkpoint root (…/checkpoints)")
    try:
        info, damaged = whole_checkpoint(root, spec_of(model).param_shapes(model))
    except CheckpointError as err:
        raise ConfigError(f"ckpt.resume={resume}: {err}") from None
    check(info is not None or damaged,
          f"ckpt.resume={resume} holds no complete checkpoint: give a root with a COMPLETE one")
    check(info is not None, f"ckpt.resume={resume} holds no whole checkpoint: {'; '.join(why for _, why in damaged)}")


def node_problem(launcher) -> str | None:
    """What keeps this host from running node ``launcher.node_rank`` (resolved launch keys), or None."""
    master, node_addr, node0 = launcher.master_addr, launcher.node_addr, launcher.node_rank == 0
    try:
        socket.getaddrinfo(master, None)
    except OSError as err:
        return f"launcher.master_addr={master} does not resolve ({_why(err)}): give node 0's host name or IP address"
    if node0 and _listen_problem(master, 0):
        return (f"launcher.master_addr={master} is not an address of this host, and node 0 (launcher.node_rank=0) "
                f"hosts the controller there: start node 0 on {master}, or give this host's address on every node")
    if node_addr and _listen_problem(node_addr, 0):
        return (f"launcher.node_addr={node_addr} is not an address of this host: give one of its own, or leave it "
                "null (its address on the route to launcher.master_addr)")
    return ports_problem(launcher) if node0 else None


def ports_problem(launcher) -> str | None:
    """What keeps node 0 from listening on its ports, or None (a port of 0 is picked free)."""
    port = launcher.master_port
    if port and (err := _listen_problem("", port)):
        return (f"launcher.master_port={port} cannot be listened on here ({_why(err)}; node 0's c10d store): "
                "stop what holds it, or give every node another free port")
    port = launcher.control_port
    if launcher.nnodes > 1 and (err := _listen_problem(launcher.master_addr, port)):
        return (f"launcher.control_port={port} cannot be listened on here ({_why(err)}; the agents' link, "
                "master_port + 1 unless set): stop what holds it, or give every node another launcher.master_port")
    return None


def store_problem(host: str, port: int) -> str | None:
    """Why an agent cannot reach node 0's c10d store, or None."""
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
    except OSError as err:
        return (f"node 0's c10d store at {host}:{port} cannot be reached from this host ({_why(err)}), though its "
                "control link can: let this host reach node 0 on launcher.master_port")
    return None


def _listen_problem(host: str, port: int) -> OSError | None:
    """Why a listening socket on ``(host, port)`` cannot be opened ("": every address, as the c10d store binds)."""
    try:
        if host:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            socket.create_server((host, port), family=family).close()
        elif socket.has_dualstack_ipv6():
            socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True).close()
        else:
            socket.create_server(("", port)).close()
    except OSError as err:
        return err
    return None


def _why(err: OSError) -> str:
    """The system's words for ``err`` (without what ``socket.create_server`` adds to them)."""
    if err.errno and err.errno > 0:
        return os.strerror(err.errno)
    return err.strerror or str(err) or type(err).__name__
