"""How to encrypt the data plane: throughput of one DEALER -> ROUTER transfer of N bytes in
2 MiB chunks between two processes on 127.0.0.1, per protection mode, in one run.

The receiver acks once every byte is in and checked; RCVHWM 32 on the receiver, SNDHWM 0 and
``copy=False`` on the sender, as in the data plane; connecting (and the CURVE handshake) is
done before the clock starts. Modes:

1. raw TCP, ``sendall`` / ``recv_into`` a preallocated buffer (the physical limit);
2. plain ZeroMQ, ``[b"C", meta, tag, data]`` multipart, meta = xfer (16 B) + seq (u32 LE);
3. ZeroMQ + Poly1305 per chunk, ``k_seq = HMAC-SHA256(key, b"dips/chunk" + meta)``, receiver
   verifies (today's integrity-only path: the insecure baseline);
4. CurveZMQ: ``curve_server`` + a ZAP ThreadAuthenticator admitting only the client's
   certificate (a client with an unknown key is checked to be refused, once per run);
5. ZeroMQ + AES-256-GCM per chunk: key = HMAC-SHA256(key, b"dips/xfer" + xfer) per transfer,
   nonce = 96-bit chunk counter, AD = meta, tag appended to the data frame (tag frame empty);
   receiver ``decrypt_into`` a preallocated buffer. Sender: 5a ``encrypt`` (fresh buffer per
   chunk); 5b ``encrypt_into`` a ring of RING buffers, each reused only once the
   MessageTracker of its last send says ZeroMQ has released it (``copy=False`` sends by
   reference, and SNDHWM 0 bounds nothing, so a ring without trackers is not safe);
6. as 5b, encrypting in a sender thread and decrypting in a receiver thread, pipelined with
   the sends / receives (AES-GCM releases the GIL);
7. as 5b with ChaCha20-Poly1305.

Each mode runs ``--repeats`` times, interleaved, after an unmeasured warm-up round. Printed:
median GB/s (1e9 B/s), min..max, ratios to raw TCP, plain ZeroMQ and mode 3 of the same run;
single-thread in-memory rates on one chunk (the CPU ceiling); load average before and after;
"others%": the most of the CPUs that other processes took during a transfer of that mode.

Usage: .venv/bin/python benchmarks/dataplane/bench_secure.py [--bytes 1073741824]
       [--chunk 2097152] [--repeats 3] [--quick]     (--quick: 256 MiB, 1 repeat, < 60 s)
Prints a table and one JSON line (``RESULT {...}``).
"""

from __future__ import annotations

import argparse
import hmac
import json
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.poly1305 import Poly1305

MP = mp.get_context("spawn")
META = struct.Struct("<16sI")
TIMEOUT_S = 60
RING = 16  # sender buffers of modes 5b, 6, 7
MODES = {  # name: (wire, protection, sender buffers, pipelined)
    "1 raw TCP": ("tcp", None, None, False),
    "2 plain ZeroMQ": ("zmq", None, None, False),
    "3 ZeroMQ+Poly1305 (insecure)": ("zmq", "poly", None, False),
    "4 CurveZMQ + ZAP": ("curve", None, None, False),
    "5a AES-GCM, encrypt (alloc)": ("zmq", "aes", "alloc", False),
    "5b AES-GCM, encrypt_into ring": ("zmq", "aes", "ring", False),
    "6 AES-GCM, pipelined threads": ("zmq", "aes", "ring", True),
    "7 ChaCha20Poly1305, ring": ("zmq", "chacha", "ring", False),
}
RAW, PLAIN, BASE = "1 raw TCP", "2 plain ZeroMQ", "3 ZeroMQ+Poly1305 (insecure)"
SECURE = [m for m in MODES if m[0] in "4567"]


def _aead(prot: str | None, key: bytes, xfer: bytes):
    if prot not in ("aes", "chacha"):
        return None
    k = hmac.digest(key, b"dips/xfer" + xfer, "sha256")  # a fresh key per transfer
    return (AESGCM if prot == "aes" else ChaCha20Poly1305)(k)


def _nonce(seq: int) -> bytes:  # counter: unique per chunk under its transfer's key
    return seq.to_bytes(12, "little")


def _options(sock: zmq.Socket) -> None:
    for opt, v in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 32),
                   (zmq.SNDTIMEO, TIMEOUT_S * 1000), (zmq.RCVTIMEO, TIMEOUT_S * 1000)):
        sock.setsockopt(opt, v)


# ----- receiver process ---------------------------------------------------------------------

def _receiver_main(conn) -> None:
    """Serves one transfer per job read from ``conn``; ``None`` (or 120 s of silence) ends it."""
    while conn.poll(120) and (job := conn.recv()) is not None:
        try:
            cpu = time.process_time()
            got = (_serve_tcp if job["wire"] == "tcp" else _serve_zmq)(job, conn)
            conn.send(("done", (got, time.process_time() - cpu)))
        except Exception as exc:  # noqa: BLE001 -- reported to the sender, which raises
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _serve_tcp(job: dict, conn) -> int:
    view, got = memoryview(bytearray(job["chunk"])), 0
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(TIMEOUT_S)
        conn.send(("port", srv.getsockname()[1]))
        with srv.accept()[0] as c:
            c.settimeout(TIMEOUT_S)
            c.sendall(c.recv(1))  # connected: the clock starts
            while got < job["nbytes"]:
                if not (n := c.recv_into(view, min(len(view), job["nbytes"] - got))):
                    raise RuntimeError("sender closed early")
                got += n
            c.sendall(b"k")
    return got


def _serve_zmq(job: dict, conn) -> int:
    ctx, auth = zmq.Context(), None
    sock = ctx.socket(zmq.ROUTER)
    try:
        _options(sock)
        if job["wire"] == "curve":
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve(domain="*", location=job["certs"])  # known client keys only
            sock.curve_secretkey, sock.curve_publickey = job["server_keys"]
            sock.curve_server = True
        conn.send(("port", sock.bind_to_random_port("tcp://127.0.0.1")))
        ident, _, xfer = sock.recv_multipart()
        sock.send_multipart([ident, b"H"])
        prot, key, aead = job["prot"], job["key"], _aead(job["prot"], job["key"], xfer)
        out = memoryview(bytearray(job["chunk"]))
        work, err = queue.Queue(maxsize=8), []

        def check(meta: bytes, tag: bytes, data: memoryview, dst: memoryview) -> int:
            if prot == "poly":
                Poly1305.verify_tag(hmac.digest(key, b"dips/chunk" + meta, "sha256"), data, tag)
            elif aead is not None:
                return aead.decrypt_into(_nonce(META.unpack(meta)[1]), data, meta, dst[:len(data) - 16])
            return len(data)

        def worker() -> None:  # mode 6: decrypts while the main thread receives
            dst = memoryview(bytearray(job["chunk"]))
            try:
                while (item := work.get(timeout=TIMEOUT_S)) is not None:
                    check(*item, dst)
            except Exception as exc:  # noqa: BLE001 -- raised by the receiving thread
                err.append(exc)
                while work.get(timeout=TIMEOUT_S) is not None:  # drain: the receiver goes on
                    pass

        th = threading.Thread(target=worker, daemon=True) if job["pipelined"] else None
        th and th.start()
        got, expect = 0, 0
        while (parts := sock.recv_multipart(copy=False))[1].bytes != b"E":
            meta, tag, data = parts[2].bytes, parts[3].bytes, parts[4].buffer
            if META.unpack(meta) != (xfer, expect):
                raise RuntimeError(f"chunk {META.unpack(meta)[1]} out of order (want {expect})")
            expect += 1
            if th:
                work.put((meta, tag, data), timeout=TIMEOUT_S)
                got += len(data) - (16 if aead else 0)
            else:
                got += check(meta, tag, data, out)
        if th:
            work.put(None, timeout=TIMEOUT_S)
            th.join(TIMEOUT_S)
            if th.is_alive() or err:
                raise RuntimeError(f"decrypt thread: {err[0]!r}" if err else "decrypt thread hung")
        sock.send_multipart([ident, b"K", struct.pack("<Q", got)])
        sock.setsockopt(zmq.LINGER, 5000)  # let the ack out before close
        return got
    finally:
        sock.close()
        auth and auth.stop()
        ctx.term()


# ----- sender (this process) ----------------------------------------------------------------

def _reply(rx, want: str):
    kind, value = rx.recv() if rx.poll(TIMEOUT_S) else ("timeout", "no answer in 60 s")
    if kind != want:
        raise RuntimeError(f"receiver: {value}")
    return value


def _cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _transfer(mode: str, nbytes: int, chunk: int, src: memoryview, rx, job0: dict):
    """One transfer of ``nbytes`` in ``mode`` to the receiver process. Returns bytes/s and the
    share of the machine's CPUs that other processes used meanwhile (interference)."""
    busy0, cpu0, wall0 = _cpu_busy_s(), time.process_time(), time.perf_counter()
    wire, prot, bufs, pipelined = MODES[mode]
    xfer = os.urandom(16)
    job = dict(job0, wire=wire, prot=prot, pipelined=pipelined, nbytes=nbytes, chunk=chunk)
    rx.send(job)
    port = _reply(rx, "port")
    plan = [(META.pack(xfer, k), off % len(src), min(chunk, nbytes - off))
            for k, off in enumerate(range(0, nbytes, chunk))]
    if wire == "tcp":
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
            s.sendall(b"h")
            s.recv(1)
            t0 = time.perf_counter()
            for _, off, n in plan:
                s.sendall(src[off:off + n])
            if s.recv(1) != b"k":
                raise RuntimeError("raw TCP: no ack")
            dt = time.perf_counter() - t0
    else:
        dt = _zmq_transfer(job, port, xfer, plan, src, bufs, rx)
    got, rx_cpu = job["early"][1] if "early" in job else _reply(rx, "done")
    if got != nbytes:
        raise RuntimeError(f"{mode}: receiver got {got} of {nbytes} bytes")
    others = _cpu_busy_s() - busy0 - (time.process_time() - cpu0) - rx_cpu
    return nbytes / dt, max(0.0, others) / (os.cpu_count() * (time.perf_counter() - wall0))


def _zmq_transfer(job, port, xfer, plan, src, bufs, rx) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        _options(sock)
        if job["wire"] == "curve":
            if job.get("check_rogue"):
                _check_rogue(ctx, port, job["server_keys"][1])
            sock.curve_secretkey, sock.curve_publickey = job["client_keys"]
            sock.curve_serverkey = job["server_keys"][1]
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([b"H", xfer])
        if sock.recv() != b"H":
            raise RuntimeError("bad handshake reply")
        prot, key, tag, aead = job["prot"], job["key"], b"\0" * 16, _aead(job["prot"], job["key"], xfer)
        ring = [memoryview(bytearray(job["chunk"] + 16)) for _ in range(RING if bufs else 0)]
        trackers: list = [None] * RING
        t0 = time.perf_counter()
        if job["pipelined"]:
            _pipelined_send(sock, aead, plan, src, ring)
        for k, (meta, off, n) in enumerate([] if job["pipelined"] else plan):
            data, slot = src[off:off + n], k % RING
            if prot == "poly":
                tag = Poly1305.generate_tag(hmac.digest(key, b"dips/chunk" + meta, "sha256"), data)
            elif bufs == "alloc":
                data, tag = aead.encrypt(_nonce(k), data, meta), b""
            elif bufs == "ring":
                trackers[slot] and trackers[slot].wait(TIMEOUT_S)  # ZeroMQ let go of it
                data, tag = ring[slot][:n + 16], b""
                aead.encrypt_into(_nonce(k), src[off:off + n], meta, data)
            trackers[slot] = sock.send_multipart(
                [b"C", meta, tag, data], copy=False, track=bufs == "ring")
        sock.send_multipart([b"E", struct.pack("<I", len(plan))])
        poller = zmq.Poller()  # the ack, or the receiver's error report (no 60 s wait)
        poller.register(sock, zmq.POLLIN)
        poller.register(rx.fileno(), zmq.POLLIN)
        if sock not in dict(poller.poll(TIMEOUT_S * 1000)) and rx.poll():
            job["early"] = rx.recv()  # ("done", n) if the ack is on its way, else the error
            if job["early"][0] != "done":
                raise RuntimeError(f"receiver: {job['early'][1]}")
        reply = sock.recv_multipart()
        dt = time.perf_counter() - t0
        if reply[0] != b"K":
            raise RuntimeError(f"bad ack {reply[:1]}")
        return dt
    finally:
        sock.close(0)
        ctx.term()


def _pipelined_send(sock, aead, plan, src, ring) -> None:
    """Mode 6: a thread encrypts into free ring slots; this thread sends them in order."""
    free, ready, err = queue.Queue(), queue.Queue(), []
    for slot in range(len(ring)):
        free.put((slot, None))

    def encrypt() -> None:
        try:
            for k, (meta, off, n) in enumerate(plan):
                slot, tr = free.get(timeout=TIMEOUT_S)
                tr and tr.wait(TIMEOUT_S)  # ZeroMQ has let go of this buffer
                aead.encrypt_into(_nonce(k), src[off:off + n], meta, ring[slot][:n + 16])
                ready.put((slot, meta, n + 16))
        except Exception as exc:  # noqa: BLE001 -- raised by the sending thread
            err.append(exc)
        finally:
            ready.put(None)

    th = threading.Thread(target=encrypt, daemon=True)
    th.start()
    while (item := ready.get(timeout=TIMEOUT_S)) is not None:
        slot, meta, m = item
        free.put((slot, sock.send_multipart([b"C", meta, b"", ring[slot][:m]], copy=False, track=True)))
    th.join(TIMEOUT_S)
    if err:
        raise RuntimeError(f"encrypt thread: {err[0]!r}")


def _check_rogue(ctx: zmq.Context, port: int, server_public: bytes) -> None:
    """A client with an unknown key must get nothing through (ZAP denies it)."""
    with ctx.socket(zmq.DEALER) as rogue:
        rogue.linger, rogue.curve_serverkey = 0, server_public
        rogue.curve_publickey, rogue.curve_secretkey = zmq.curve_keypair()
        rogue.connect(f"tcp://127.0.0.1:{port}")
        rogue.send_multipart([b"H", os.urandom(16)], zmq.NOBLOCK)
        if rogue.poll(1000):
            raise RuntimeError("CURVE/ZAP admitted an unknown client key")


def ceilings(chunk: int) -> dict[str, float]:
    """Single-thread in-memory GB/s on one chunk (each timed for >= 0.25 s)."""
    data, key = memoryview(bytearray(os.urandom(chunk))), os.urandom(32)
    ct, pt, nonce = memoryview(bytearray(chunk + 16)), memoryview(bytearray(chunk)), _nonce(0)
    aes, cha = AESGCM(key), ChaCha20Poly1305(key)
    aes_ct, cha_ct = aes.encrypt(nonce, data, b"m"), cha.encrypt(nonce, data, b"m")
    fns = {"memcpy": lambda: pt.__setitem__(slice(None), data),
           "Poly1305": lambda: Poly1305.generate_tag(key, data),
           "AES-GCM enc_into": lambda: aes.encrypt_into(nonce, data, b"m", ct),
           "AES-GCM enc(alloc)": lambda: aes.encrypt(nonce, data, b"m"),
           "AES-GCM dec_into": lambda: aes.decrypt_into(nonce, aes_ct, b"m", pt),
           "ChaCha enc_into": lambda: cha.encrypt_into(nonce, data, b"m", ct),
           "ChaCha dec_into": lambda: cha.decrypt_into(nonce, cha_ct, b"m", pt)}
    out = {}
    for name, fn in fns.items():
        n, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < 0.25:
            fn()
            n += 1
        out[name] = n * chunk / dt / 1e9
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--chunk", type=int, default=2 << 20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 MiB, 1 repeat")
    args = ap.parse_args(argv)
    if args.quick:
        args.bytes, args.repeats = 256 << 20, 1
    chunk, nbytes = args.chunk, args.bytes
    load0 = os.getloadavg()
    print(f"{nbytes / (1 << 20):g} MiB per transfer in {chunk / (1 << 20):g} MiB chunks, "
          f"{args.repeats} repeats, {os.cpu_count()} CPUs, ring {RING}; load average before "
          f"{' '.join(f'{x:.2f}' for x in load0)}", flush=True)
    ceil = ceilings(chunk)
    print("in-memory, 1 thread, 1 chunk (GB/s): "
          + ", ".join(f"{k} {v:.2f}" for k, v in ceil.items()), flush=True)

    src = memoryview(bytearray(os.urandom(max(chunk, (64 << 20) // chunk * chunk))))  # > LLC
    tmp = Path(tempfile.mkdtemp(prefix="bench_secure_"))
    rx, child_end = MP.Pipe()
    proc = MP.Process(target=_receiver_main, args=(child_end,), daemon=True)
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    other: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        (tmp / "public").mkdir()
        pub, sec = zmq.auth.create_certificates(tmp, "client")
        shutil.copy(pub, tmp / "public")  # the ZAP handler's directory: the client's public key
        spub, ssec = zmq.curve_keypair()
        job0 = {"key": os.urandom(32), "certs": str(tmp / "public"), "server_keys": (ssec, spub),
                "client_keys": zmq.auth.load_certificate(sec)[::-1]}
        proc.start()
        for m in MODES:  # warm-up (first touch, allocator, code paths); checks ZAP refusal
            _transfer(m, min(nbytes, 64 << 20), chunk, src, rx, dict(job0, check_rogue=True))
        for r in range(args.repeats):
            for m in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                rate, busy = _transfer(m, nbytes, chunk, src, rx, job0)
                runs[m].append(rate / 1e9)
                other[m].append(busy)
            print(f"  repeat {r}: " + ", ".join(f"{m.split()[0]} {runs[m][-1]:.2f}" for m in MODES)
                  + f" GB/s; other processes used {max(other[m][-1] for m in MODES):.0%} of the "
                  "CPUs at most", flush=True)
    finally:
        if proc.is_alive():
            rx.send(None)
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()

    med = {m: statistics.median(v) for m, v in runs.items()}
    print(f"\n{'mode':32s} {'GB/s':>6s} {'min..max':>11s} {'%raw':>6s} {'%zmq':>6s} {'%mode3':>7s}"
          f" {'others%':>8s}")
    for m in MODES:
        print(f"{m:32s} {med[m]:6.2f} {min(runs[m]):5.2f}..{max(runs[m]):<4.2f} {med[m] / med[RAW]:6.0%}"
              f" {med[m] / med[PLAIN]:6.0%} {med[m] / med[BASE]:7.0%} {max(other[m]):8.0%}")
    best, second = sorted(SECURE, key=med.get)[::-1][:2]
    close = " - within the run-to-run spread" if min(runs[best]) <= max(runs[second]) else ""
    print(f"load average after {' '.join(f'{x:.2f}' for x in load1)}")
    print(f"conclusion: fastest secure mode is {best} at {med[best]:.2f} GB/s = "
          f"{med[best] / med[BASE]:.0%} of the insecure Poly1305 baseline, "
          f"{med[best] / med[RAW]:.0%} of raw TCP (next: {second}, {med[second]:.2f} GB/s{close})")
    out = {"bytes": nbytes, "chunk": chunk, "repeats": args.repeats, "ring": RING,
           "median_gbps": med, "runs_gbps": runs, "ceilings_gbps": ceil,
           **{f"ratio_vs_{k}": {m: med[m] / med[ref] for m in MODES}
              for k, ref in (("raw_tcp", RAW), ("zmq", PLAIN), ("mode3", BASE))},
           "fastest_secure": best, "curve_rejects_unknown_key": True,
           "other_processes_cpu_share": other, "loadavg_before": load0, "loadavg_after": load1}
    print("RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
