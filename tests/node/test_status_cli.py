"""``dips status`` and the members as commands (review 15): gRPC's own log lines stay off
stderr, an address that is not the leader's is named as what it is (plaintext: the refusal
NOT_LEADER of a follower's control server; TLS: the certificate the server holds), `dips --help`
lists each command's summary on one line, as its docstring reads, and off a terminal the
screen is printed full width, once per look with ``--watch``."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dips.cli import app
from dips.node.common import RoleError, fetch_spec
from dips.wire.control import make_server
from dips.wire.not_leader import NotLeaderServicer
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity, init_pki
from dips.wire.security import Credentials
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import Site, make_leader

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
#: A line of gRPC's C core (absl format): "I1202 16:11:26.664645   30999 file.cc:2563] ...".
CORE_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.M)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """This run's PKI (one follower, cluster a) and another run's beside it (``other``)."""
    root = tmp_path_factory.mktemp("pki")
    init_pki(root / "run", 1, ["a"])
    init_pki(root / "other", 1, ["a"])
    return root


def serve(servicer, creds: Credentials):
    """A gRPC server on a free 127.0.0.1 port with ``servicer`` as its Leader service."""
    server = make_server(max_workers=4)
    pbg.add_LeaderServicer_to_server(servicer, server)
    port = creds.add_port(server, "127.0.0.1:0")
    server.start()
    return server, port


def status_process(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``python -m dips.cli status ARGS`` as a process of its own (gRPC's C core writes to
    the process's stderr, which an in-process runner cannot see)."""
    base = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    return subprocess.run([sys.executable, "-m", "dips.cli", "status", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**base, **env})


def test_grpc_core_lines_stay_off_stderr_unless_the_user_asks(tmp_path, pki):
    """Review 15, #5: a TLS handshake refused by the leader (another run's bundle) printed
    gRPC's "I… ssl_transport_security.cc] Handshake failed" line above dips's own message."""
    leader, _ = make_leader(tmp_path)
    server, port = serve(LeaderServicer(leader, None), Credentials.tls(pki / "run" / "leader"))
    try:
        args = ["--leader", f"127.0.0.1:{port}", "--tls", str(pki / "other" / "admin"),
                "--timeout", "5"]
        quiet = status_process(args)
        assert quiet.returncode == 2, quiet.stderr
        assert quiet.stderr.strip().splitlines() == [
            f"dips status: leader 127.0.0.1:{port}: its certificate is not signed by the CA "
            "of this --tls bundle (another run's pki/?)"]
        told = status_process(args, GRPC_VERBOSITY="INFO")  # the user's own setting wins
        assert told.returncode == 2 and CORE_LINE.search(told.stderr), told.stderr
    finally:
        server.stop(0).wait(5)
        leader.stop()


def test_a_followers_port_given_as_the_leaders_is_named_plaintext_and_tls(pki):
    """Review 15, #6: `dips status` (or a member) at a follower's control port got gRPC's
    UNIMPLEMENTED (plaintext) or a bare UNAVAILABLE (TLS) and no word of what it reached."""
    what = "follower 0's control service (its leader: 127.0.0.1:7000)"
    for creds, bundle in ((Credentials.insecure(Identity.follower(0)), None),
                          (Credentials.tls(pki / "run" / "follower-0"), pki / "run")):
        server, port = serve(NotLeaderServicer(what), creds)
        addr = f"127.0.0.1:{port}"
        try:
            opts = ["--insecure"] if bundle is None else ["--tls", str(bundle / "admin")]
            out = CliRunner().invoke(app, ["status", "--leader", addr, *opts, "--timeout", "5"])
            assert out.exit_code == 2, out.output
            says = (f"{addr}: this is {what}, not the leader (GetStatus refused)"
                    if bundle is None else
                    f"{addr} holds the certificate of 'follower-0', not the leader's")
            assert f"dips status: {says}" in out.stderr
            member = (Credentials.insecure(Identity.cluster("a")) if bundle is None
                      else Credentials.tls(bundle / "cluster-a"))
            with pytest.raises(RoleError) as info:  # at once, not after 60 s of retries
                fetch_spec(addr, member, threading.Event(), 60.0)
            assert str(info.value).startswith(f"--leader {addr}")
            assert ("follower 0's control service" if bundle is None else "'follower-0'") \
                in str(info.value)
        finally:
            server.stop(0).wait(5)


def test_the_command_list_gives_each_summary_on_one_line():
    """Review 15, #12: a summary whose docstring is wrapped broke mid-sentence in `dips
    --help` (typer's rich help kept the docstring's line breaks), e.g. "whose ranks are" /
    "the stage workers"; also `dips bench --help`."""
    from dips.bench.cli import app as bench_app
    from dips.cli import app as dips_app

    for typer_app, argv in ((dips_app, ["--help"]), (bench_app, ["bench", "--help"])):
        out = CliRunner().invoke(app, argv, env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
        assert out.exit_code == 0, out.output
        lines = out.stdout.splitlines()
        for info in typer_app.registered_commands:
            doc = info.callback.__doc__ or ""
            summary = " ".join(doc.strip().split("\n\n")[0].split())
            assert any(summary in line for line in lines), (summary, out.stdout)


CLUSTER_HEADER = ("cluster", "inner step", "tokens trained", "tokens accepted", "tokens pushed",
                  "last loss", "last push",
                  "pulled version", "staleness", "heartbeat")


def whole_header(text: str) -> bool:
    """Whether the clusters table's header row is on one line, every column named whole."""
    return any(all(h in line for h in CLUSTER_HEADER) for line in text.splitlines())


def test_off_a_terminal_the_screen_is_full_width_and_watch_prints_each_look(tmp_path):
    """Review 15, #11: off a terminal (a pipe, a file) the screen was cut to 80 columns (the
    clusters table's header wrapped), and `--watch` printed nothing until it ended."""
    site = Site(tmp_path)
    site.join("cluster-a")
    addr = f"127.0.0.1:{site.port}"
    proc = None
    try:
        once = CliRunner().invoke(app, ["status", "--leader", addr, "--insecure"],
                                  env={"COLUMNS": None})
        assert once.exit_code == 0 and whole_header(once.stdout), once.stdout
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        proc = subprocess.Popen([sys.executable, "-m", "dips.cli", "status", "--leader", addr,
                                 "--insecure", "--watch", "--every", "0.2"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
        seen, looks, deadline = [], 0, time.monotonic() + 60
        while looks < 3 and time.monotonic() < deadline:  # the event: three looks printed
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            seen.append(line)
            looks += line.startswith("--- dips status at ")
        assert looks == 3 and proc.poll() is None, "".join(seen)  # while it still runs
        assert whole_header("".join(seen)), "".join(seen)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        site.close()
