"""A Flower deployment on loopback: one SuperLink and N SuperNodes as real processes.

:class:`LoopbackDeployment` starts ``flower-superlink`` and ``flower-supernode``
(flwr 1.42: one HTTPS port per SuperLink for its Fleet, Control and Runtime APIs; one
Runtime port per SuperNode) on free ports of 127.0.0.1, each SuperNode with
``--node-config "partition-id=i num-partitions=N"``, then submits the digits fleet app
(:mod:`taste_cl.adapters.flower.app`) with ``flwr run --stream`` and waits for it,
bounded by ``timeout_s``. Flower's own logs go to files in the work folder unless
``verbose``. On exit, normal or not (Ctrl-C included), it stops every process it
started *and their descendants* by PID: SuperLink and SuperNode start their
``flower-superexec`` in a new session, so killing a process group is not enough.

Secure by default, also on loopback (:mod:`taste_cl.adapters.flower.tls`): a CA and a
SuperLink certificate for 127.0.0.1 are generated for the run, the SuperLink serves TLS
with ``--enable-supernode-auth``, every SuperNode gets its own EC key, registered with
``flwr supernode register`` before it starts, and verifies the SuperLink against the
run's CA. A SuperNode whose key is not registered, or that does not trust the CA, is
refused. ``insecure=True`` (plain HTTP, any SuperNode may join) only when asked for,
with a warning.

Under load: in flwr 1.42 every message a SuperNode receives starts a fresh
``flwr-clientapp`` process, and every run a ``flwr-serverapp`` process, and a task whose
process has not sent its first heartbeat within ``HEARTBEAT_DEFAULT_INTERVAL`` (30 s,
no option or environment variable sets it) of being claimed goes back to pending and is
claimed and started *again*, while the late process is still starting; on a saturated
machine (10-20 devices starting at once on 2 shared cores) the extra starts add load and
the round never completes. The SuperLink and the SuperNodes therefore start through
:func:`launch_command`, which sets that constant (the task's start window, and twice it
the heartbeat patience of a running task and of a node) to ``start_window_s``
(default 180 s) before flwr reads it. The driver samples the deployment's processes
about once a second with one scan of the process table: the fleet's resident memory
(the sum over the SuperLink, SuperNodes, their SuperExecs, the ServerApp and ClientApp
processes) is reported per run as ``result["deployment"]["peak_rss_mb"]``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import psutil

from taste_cl._checks import check_int
from taste_cl.adapters.flower.app import FleetConfig, read_outputs
from taste_cl.adapters.flower.fleet import require_flwr
from taste_cl.adapters.flower.tls import NodeKey, TlsFiles, write_certificates, write_node_key
from taste_cl.exceptions import DeploymentError, InsecureDeploymentWarning

__all__ = ["DeploymentError", "LoopbackDeployment", "free_port", "launch_command"]

_APP_MODULE = "taste_cl_fleet_app"
_CLIENT_MODULE = "taste_cl_fleet_client"  # device="artifacts": the ClientApp process imports only this (no torch)
_HOSTS = ["127.0.0.1", "localhost"]
INSECURE_WARNING = (
    "insecure deployment: no TLS (traffic in clear text) and no SuperNode authentication "
    "(any process that reaches the port may join the fleet); use it only to debug on loopback"
)


_ENTRY_POINTS = {"flower-superlink": "flwr.superlink.cli:flower_superlink", "flower-supernode": "flwr.supernode.cli:flower_supernode"}
_TRACK_EVERY_S = 1.0
_SERVERAPP_FAILED = "An unhandled exception occurred in the ServerApp"  # flwr 1.42's words; `flwr run --stream` keeps running
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception)\b.*")


def _serverapp_failure(log: str) -> str | None:
    """The exception a failed ServerApp raised, from the log of ``flwr run --stream``; None while it has not failed.

    In flwr 1.42 the CLI goes on streaming after the ServerApp dies, so without this a
    failed run would only end at the deployment's timeout.
    """
    if _SERVERAPP_FAILED not in log:
        return None
    raised = [line for line in log.splitlines() if _EXCEPTION_LINE.match(line)]
    return raised[-1] if raised else _SERVERAPP_FAILED


def launch_command(executable: str, start_window_s: float) -> list[str]:
    """The command line that runs ``flower-superlink`` or ``flower-supernode`` with a task start window of ``start_window_s``.

    It sets ``flwr.common.constant.HEARTBEAT_DEFAULT_INTERVAL`` before flwr's modules
    import it, then checks that the task state read the new value (so a flwr release that
    moves the constant fails loudly instead of silently keeping 30 s).
    """
    if executable not in _ENTRY_POINTS:
        raise ValueError(f"`executable == {executable!r}`, must be one of {sorted(_ENTRY_POINTS)}")
    if not (isinstance(start_window_s, (int, float)) and 30 <= start_window_s <= 900):
        raise ValueError(f"`start_window_s == {start_window_s!r}`, must be a number in [30, 900] (flwr allows node heartbeats up to 1800 s)")
    module, function = _ENTRY_POINTS[executable].split(":")
    window = int(start_window_s)
    code = "\n".join(
        [
            "import sys",
            "import flwr.common.constant as constant",
            f"constant.HEARTBEAT_DEFAULT_INTERVAL = {window}",
            f"from {module} import {function}",
            "from flwr.supercore.corestate import in_memory_corestate",
            f"assert in_memory_corestate.HEARTBEAT_DEFAULT_INTERVAL == {window}, 'flwr read its task start window before it was set'",
            f"sys.argv[0] = {executable!r}",
            f"sys.exit({function}())",
        ]
    )
    return [sys.executable, "-c", code]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, deadline: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DeploymentError(f"flower-superlink exited with code {proc.returncode}; see {log}")
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise DeploymentError(f"flower-superlink did not listen on 127.0.0.1:{port} in time; see {log}")


def _pyproject(config: FleetConfig) -> str:
    """The Flower App's pyproject: components from :func:`_app_module`, run config = ``config``."""
    lines = [
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "[project]",
        'name = "taste-cl-fleet"',
        'version = "1.0.0"',
        "dependencies = []",
        "[tool.hatch.build.targets.wheel]",
        'packages = ["."]',
        "[tool.flwr.app]",
        'publisher = "taste-cl"',
        "[tool.flwr.app.components]",
        f'serverapp = "{_APP_MODULE}:server_app"',
        f'clientapp = "{_CLIENT_MODULE if config.device == "artifacts" else _APP_MODULE}:client_app"',
        "[tool.flwr.app.config]",
    ]
    for key, value in config.to_run_config().items():
        lines.append(f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _app_module(config: FleetConfig) -> str:
    """The app module's source: the plain app, or the SecAgg+ one (each process imports only its own)."""
    module = "secagg" if config.secagg else "app"
    return f"from taste_cl.adapters.flower.{module} import client_app, server_app\n\n__all__ = ['client_app', 'server_app']\n"


def _client_module(config: FleetConfig) -> str:
    """The device-runtime ClientApp's module source (plain or SecAgg+): it imports numpy, flwr and ONNX Runtime, never torch."""
    name = "secagg_client_app as client_app" if config.secagg else "client_app"
    return f"from taste_cl.adapters.flower.device_client import {name}\n\n__all__ = ['client_app']\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


class LoopbackDeployment:
    """SuperLink + ``devices`` SuperNodes on 127.0.0.1; use as a context manager.

    >>> with LoopbackDeployment(devices=3) as fleet:          # doctest: +SKIP
    ...     result, server, devices = fleet.run(FleetConfig(devices=3, rounds=2))

    ``timeout_s`` bounds startup plus each run; ``start_window_s`` is the time a
    ClientApp or ServerApp process has to report after its task is claimed (flwr's 30 s,
    widened: see the module docstring). The work folder (logs, app, Flower
    home, the run's certificates and SuperNode keys) is a fresh temporary folder,
    removed on exit unless ``keep``. TLS and SuperNode authentication are on unless
    ``insecure=True``, which warns.
    """

    def __init__(
        self,
        devices: int,
        *,
        timeout_s: float = 300.0,
        verbose: bool = False,
        keep: bool = False,
        insecure: bool = False,
        start_window_s: float = 180.0,
    ) -> None:
        check_int("devices", devices, 1)
        launch_command("flower-supernode", start_window_s)  # checks start_window_s
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"`timeout_s == {timeout_s!r}`, must be a number > 0")
        if not isinstance(insecure, bool):
            raise TypeError(f"insecure must be a bool; got {type(insecure).__name__}")
        self.devices, self.timeout_s, self.verbose, self.keep, self.insecure = devices, float(timeout_s), verbose, keep, insecure
        self.start_window_s = float(start_window_s)
        self.tls: TlsFiles | None = None  # the run's CA and SuperLink certificate, made at start()
        self.keys: list[NodeKey] = []  # the registered SuperNodes' keys, by partition
        self.work: Path | None = None
        self.port = 0  # the SuperLink's port, chosen at start()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._seen: dict[int, psutil.Process] = {}  # descendants, remembered while their parents live
        self._peak_rss = 0  # bytes, the largest sum over the live processes seen in one scan (reset per run)
        self._logs: list[IO[bytes]] = []
        self._bin = Path(sys.executable).parent

    # ---------------------------------------------------------------- process plumbing
    def _env(self) -> dict[str, str]:
        import taste_cl

        assert self.work is not None
        env = dict(os.environ)
        root = str(Path(taste_cl.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
        env["PATH"] = os.pathsep.join([str(self._bin), env.get("PATH", "")])
        env["FLWR_HOME"] = str(self.work / "flwr-home")
        env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        assert self.work is not None
        out: Any = None
        if not self.verbose:
            out = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop())
            self._logs.append(out)
        command = launch_command(args[0], self.start_window_s) if args[0] in _ENTRY_POINTS else [str(self._bin / args[0])]
        proc = subprocess.Popen(
            [*command, *args[1:]],
            env=self._env(),
            cwd=self.work,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,  # Ctrl-C reaches us, not them: we stop them in order
        )
        self.procs.append(proc)
        return proc

    def start(self) -> LoopbackDeployment:
        """Start the SuperLink, wait until it listens, register the SuperNodes' keys, start the SuperNodes."""
        require_flwr()
        if self.procs:
            raise DeploymentError("this deployment is already started")
        if self.insecure:
            warnings.warn(INSECURE_WARNING, InsecureDeploymentWarning, stacklevel=2)
        self.work = Path(tempfile.mkdtemp(prefix="taste-cl-fleet-"))
        deadline = time.monotonic() + self.timeout_s
        try:
            self.port = free_port()
            home = self.work / "flwr-home"
            home.mkdir()
            link = ["flower-superlink", "--insecure"]
            trust = "insecure = true"
            if not self.insecure:
                self.tls = write_certificates(self.work / "tls", hosts=_HOSTS)
                link = ["flower-superlink", *self._tls_args(), "--enable-supernode-auth"]
                trust = f"root-certificates = {_toml(str(self.tls.ca_cert))}"
            (home / "config.toml").write_text(
                f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n{trust}\n'
            )
            proc = self._spawn("superlink", [*link, "--port", str(self.port), "--disable-runtime-dependency-installation"])
            _wait_for_port(self.port, deadline, proc, self.work / "superlink.log")
            if not self.insecure:
                self.keys = [write_node_key(self.work / "tls", f"supernode-{i}") for i in range(self.devices)]
                self.register(self.keys, deadline)
            for i in range(self.devices):
                self._spawn(f"supernode-{i}", self.supernode_args(i, self.keys[i] if self.keys else None))
        except BaseException:
            self.stop()
            raise
        return self

    def _tls_args(self) -> list[str]:
        assert self.tls is not None
        return ["--ssl-ca-certfile", str(self.tls.ca_cert), "--ssl-certfile", str(self.tls.server_cert), "--ssl-keyfile", str(self.tls.server_key)]

    def supernode_args(self, partition: int, key: NodeKey | None, *, trust_ca: bool = True, max_retries: int | None = None) -> list[str]:
        """The ``flower-supernode`` command for device ``partition``: TLS against the run's CA, signed with ``key``.

        ``trust_ca=False`` leaves the run's CA out (the SuperNode then checks the
        SuperLink against the system's CAs, as a stranger would); ``max_retries``
        bounds its connection attempts (default: Flower's, unbounded).
        """
        if self.insecure:
            security = ["--insecure"]
        else:
            if key is None:
                raise ValueError("a SuperNode of a secure deployment needs a key (NodeKey)")
            assert self.tls is not None
            security = ["--root-certificates", str(self.tls.ca_cert)] if trust_ca else []
            security += ["--auth-supernode-private-key", str(key.private_key)]
        retries = [] if max_retries is None else ["--max-retries", str(max_retries)]
        return [
            "flower-supernode",
            *security,
            *retries,
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--port",
            str(free_port()),
            "--node-config",
            f"partition-id={partition} num-partitions={self.devices}",
        ]

    def register(self, keys: list[NodeKey], deadline: float | None = None) -> None:
        """Register SuperNode public keys with the SuperLink (``flwr supernode register``, all at once)."""
        if self.work is None or not self.procs:
            raise DeploymentError("start the deployment first (use it as a context manager)")
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        clis = [
            subprocess.Popen(
                [str(self._bin / "flwr"), "supernode", "register", str(key.public_key), "loopback"],
                env=self._env(),
                cwd=self.work,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for key in keys
        ]
        failures = []
        for key, cli in zip(keys, clis):
            try:
                out, _ = cli.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                cli.kill()
                out, _ = cli.communicate()
            if cli.returncode != 0:
                failures.append(f"{key.public_key.name}: {out.decode(errors='replace').strip()[-400:]}")
        if failures:
            raise DeploymentError("could not register SuperNode keys with the SuperLink: " + "; ".join(failures))

    def run(self, config: FleetConfig) -> tuple[dict[str, Any], dict[str, Any], dict[int, dict[str, Any]]]:
        """Submit one run of the fleet app with ``config`` and wait for it (``read_outputs``' triple).

        The result also holds ``result["deployment"]``: the run's ``wall_s`` (from ``flwr
        run`` to the devices' last files) and ``peak_rss_mb``, the largest resident memory
        of the whole deployment (every process it started and their descendants) sampled
        about once a second during the run.
        """
        if not isinstance(config, FleetConfig):
            raise TypeError(f"config must be a FleetConfig; got {type(config).__name__}")
        if config.devices != self.devices:
            raise ValueError(f"`config.devices == {config.devices}`, must equal the deployment's {self.devices}")
        if self.work is None or not self.procs:
            raise DeploymentError("start the deployment first (use it as a context manager)")
        out = Path(tempfile.mkdtemp(prefix="run-", dir=self.work))
        config = FleetConfig(**{**config.__dict__, "out_dir": str(out)})
        app = out / "app"
        app.mkdir()
        (app / "pyproject.toml").write_text(_pyproject(config))
        (app / f"{_APP_MODULE}.py").write_text(_app_module(config))
        if config.device == "artifacts":
            (app / f"{_CLIENT_MODULE}.py").write_text(_client_module(config))
        log = None if self.verbose else open(out / "flwr-run.log", "wb")  # noqa: SIM115
        try:
            cli = subprocess.Popen(
                [str(self._bin / "flwr"), "run", str(app), "loopback", "--stream"],
                env=self._env(),
                cwd=out,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                start_new_session=True,
            )
            self.procs.append(cli)
            started = time.monotonic()
            deadline, tracked = started + self.timeout_s, 0.0
            self._peak_rss = 0
            while not (out / "result.json").exists():
                if time.monotonic() > deadline:
                    raise DeploymentError(f"the fleet run did not finish in {self.timeout_s:g} s; logs in {self.work}")
                if cli.poll() is not None and cli.returncode != 0:
                    raise DeploymentError(f"`flwr run` exited with code {cli.returncode}; see {out / 'flwr-run.log'}")
                if time.monotonic() - tracked >= _TRACK_EVERY_S:
                    self._track()
                    tracked = time.monotonic()
                    failure = None if log is None else _serverapp_failure((out / "flwr-run.log").read_text(errors="replace"))
                    if failure is not None:
                        raise DeploymentError(f"the ServerApp failed: {failure}; see {out / 'flwr-run.log'}")
                time.sleep(0.25)
            self._wait_for_devices(out, deadline)
            result, server, devices = read_outputs(out)
            result["deployment"] = {"wall_s": time.monotonic() - started, "peak_rss_mb": self._peak_rss / 2**20}
            return result, server, devices
        finally:
            if log is not None:
                log.close()

    def _wait_for_devices(self, out: Path, deadline: float) -> None:
        """The server writes its result after the last evaluate replies, so device files exist; re-check briefly."""
        while len(list(out.glob("device-*.npz"))) < self.devices and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop every started process and all their descendants (TERM, then KILL after 10 s)."""
        self._track()
        victims = list(self._seen.values())
        for victim in victims:
            try:
                victim.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(victims, timeout=10)
        for victim in alive:
            try:
                victim.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        for proc in self.procs:
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        self._seen.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self.work is not None and not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None

    def _track(self) -> None:
        """Remember the started processes and their descendants, and the peak of their summed RSS.

        One scan of the process table per call (``children(recursive=True)`` per started
        process scanned it once each, ~20 scans a call with 20 SuperNodes); psutil's
        handles guard against PID reuse.
        """
        table: dict[int, psutil.Process] = {}
        by_parent: dict[int, list[int]] = {}
        for p in psutil.process_iter(["ppid"]):
            table[p.pid] = p
            by_parent.setdefault(p.info["ppid"], []).append(p.pid)
        stack, rss = [proc.pid for proc in self.procs if proc.pid in table], 0
        while stack:
            pid = stack.pop()
            process = self._seen.setdefault(pid, table[pid])
            stack.extend(by_parent.get(pid, []))
            try:
                rss += process.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self._peak_rss = max(self._peak_rss, rss)

    @property
    def pids(self) -> list[int]:
        """PIDs of the started processes and the descendants seen so far that are still running."""
        self._track()
        return sorted(pid for pid, p in self._seen.items() if p.is_running())

    def __enter__(self) -> LoopbackDeployment:  # noqa: PYI034 (Self needs Python 3.11)
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
