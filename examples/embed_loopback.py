"""Embedding Lynx: a sender and a receiver over lynx_transport on loopback, with the codec.

    python examples/embed_loopback.py [--planes 4,4] [--tokens 4096] [--gbps 1] [--backend auto]

Run as above, this process is the receiver (the decode node) and starts the
sender (the prefill node) as a second process. The sender encodes one random
K/V layer (SmolLM2-135M's shape, [3, tokens, 64]) with
``lynx_decode.encode_layer`` into one buffer per plane and sends each buffer on
its own lane: plane 0 (the anchor, with the scales) on ``Lane.ANCHOR``, plane 1
on ``Lane.RESIDUAL`` (with more planes, plane i on lane i), its link held to
``--gbps`` Gbit/s by the sender's shaper (0: unshaped). The layer's layout
descriptor travels as the stream's metadata. The receiver decodes a draft from
the anchor alone as soon as that lane has landed, then the exact layer from
every plane, and checks that it is bitwise what INT8 quantization of the same
K/V gives. It prints one line (``embed_loopback: ok ...``) and exits 0, or 1 on
a mismatch.

Needs ``pip install "lynx-kv[ucx]"`` and nothing else: no torch, no GPU, no
model. The codec runs on NumPy arrays: ``--backend auto`` (the default, as
``encode_layer`` without a backend) uses the Numba kernels, which a fresh
install compiles on first use (about a minute on two cores; cached next to the
installed package, then about a second); ``--backend numpy`` runs the NumPy
reference that defines the format, with no compile step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time

import numpy as np

from lynx_decode.codec import (
    Backend,
    CodecConfig,
    LayerLayout,
    Scheme,
    decode_layer,
    encode_layer,
    int8_codes,
    parse_planes,
)
from lynx_transport import Lane, Rate, ReceivePool, Receiver, ReceiveStream, connect
from lynx_transport.errors import TransportTimeoutError

KV_HEADS, HEAD_DIM = 3, 64  # SmolLM2-135M's K/V shape per layer: [3, tokens, 64]
TIMEOUT_S = 60.0  # each wait once the stream is open
START_TIMEOUT_S = 600.0  # for the stream to open: the sender may be compiling the Numba kernels first


def random_layer(seed: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's K and V, [kv_heads, tokens, head_dim] float32 (K with a few large channels, as after RoPE)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((KV_HEADS, tokens, HEAD_DIM), dtype=np.float32)
    k *= rng.uniform(0.5, 4.0, size=(KV_HEADS, 1, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((KV_HEADS, tokens, HEAD_DIM), dtype=np.float32)
    return k, v


def send(address: tuple[str, int], args: argparse.Namespace) -> None:
    """The prefill node: encode the layer, send each plane's buffer on its lane."""
    seed, gbps = args.seed, args.gbps
    k, v = random_layer(seed, args.tokens)
    layer = encode_layer(k, v, CodecConfig(planes=parse_planes(args.planes)), backend=Backend(args.backend))
    metadata = json.dumps({"layout": layer.layout.to_json(), "seed": seed}).encode()
    # plane i travels on lane i: plane 0 on Lane.ANCHOR (0), plane 1 on Lane.RESIDUAL (1), ...
    regions = [(f"plane{p.index}", layer.buffers[p.index], p.lane) for p in layer.layout.plane_table]
    with connect(address, timeout=TIMEOUT_S) as conn:
        if gbps:  # optional; per lane: conn.set_lane_rate
            conn.set_link_rate(Rate(gbps=gbps))
        stream = conn.send_stream(regions, metadata=metadata)
        stream.wait(timeout=TIMEOUT_S)  # done once the receiver confirmed every byte


def rel_error(x: np.ndarray, x_hat: np.ndarray) -> float:
    return float(np.linalg.norm(x - x_hat) / np.linalg.norm(x))


def first_stream(rx: Receiver, sender: subprocess.Popen) -> ReceiveStream:
    """The sender's stream, once open; fails at once when the sender dies first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return rx.next_stream(timeout=1.0)
        except TransportTimeoutError:
            if sender.poll() is not None:
                raise SystemExit(f"embed_loopback: FAILED the sender exited with {sender.returncode} "
                                 "before its stream opened") from None
            if time.monotonic() > deadline:
                raise


def receive(args: argparse.Namespace) -> int:
    """The decode node: receive into a pool, draft on the anchor, check the exact layer against INT8."""
    landed: list[int] = []  # lanes in the order they completed (on_lane_complete runs on the callback thread)
    with Receiver(ReceivePool(32 << 20), on_lane_complete=lambda s, lane: landed.append(int(lane))) as rx:
        host, port = rx.address  # 127.0.0.1 and a free port
        sender = subprocess.Popen([sys.executable, __file__, "--send", f"{host}:{port}", "--seed", str(args.seed),
                                   "--tokens", str(args.tokens), "--planes", args.planes,
                                   "--gbps", str(args.gbps), "--backend", args.backend])
        try:
            stream = first_stream(rx, sender)  # the manifest and metadata arrive before the data
            opened = time.monotonic()
            meta = json.loads(stream.metadata)
            layout = LayerLayout.from_json(meta["layout"])  # validated: regions exactly where build() puts them
            names = [f"plane{p}" for p in range(layout.num_planes)]

            stream.wait_lane(Lane.ANCHOR, timeout=TIMEOUT_S)
            backend = Backend(args.backend)
            # the draft, from the anchor alone (a view into the pool, no copy)
            k_draft, v_draft = decode_layer(layout, stream.view(names[0]), backend=backend)
            stream.wait(timeout=TIMEOUT_S)
            k_exact, v_exact = decode_layer(layout, *(stream.view(n) for n in names), backend=backend)
            codes = int8_codes(layout, *(stream.view(n) for n in names), backend=backend)
            lane_ms = {lane: (t - opened) * 1e3 for lane, t in stream.lane_completed_at.items()}
            lane_bytes = {r.lane: r.nbytes for r in stream.regions}
            stream.release()
        finally:
            try:
                sender_rc = sender.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                sender.kill()
                sender_rc = sender.wait()

    # the reference: INT8 with the same grid (LYNX with every plane is bitwise INT8), by the NumPy reference
    k, v = random_layer(meta["seed"], layout.tokens)
    int8 = encode_layer(k, v, dataclasses.replace(layout.config, scheme=Scheme.INT8), backend=Backend.NUMPY)
    k_int8, v_int8 = decode_layer(int8.layout, int8.buffers[0], backend=Backend.NUMPY)
    codes_int8 = int8_codes(int8.layout, int8.buffers[0], backend=Backend.NUMPY)
    equal = (np.array_equal(k_exact, k_int8) and np.array_equal(v_exact, v_int8)
             and all(np.array_equal(a, b) for a, b in zip(codes, codes_int8)))
    ok = equal and sender_rc == 0
    lanes = ",".join(f"{lane}:{lane_bytes[lane]}B" for lane in sorted(lane_bytes))
    print(f"embed_loopback: {'ok' if ok else 'FAILED'} planes={','.join(map(str, layout.planes))} "
          f"backend={args.backend} shape={'x'.join(map(str, layout.shape))} lanes={lanes} "
          f"landed={','.join(map(str, landed))} "
          f"anchor_ms={lane_ms[Lane.ANCHOR]:.2f} full_ms={max(lane_ms.values()):.2f} "
          f"draft_err_k={rel_error(k, k_draft):.4f} draft_err_v={rel_error(v, v_draft):.4f} "
          f"equal_to_int8={equal} sender_rc={sender_rc}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planes", default="4,4", help="the LYNX split, bit widths from the top: 4,4 | 3,5 | 2,2,4")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gbps", type=float, default=1.0, help="the sender's link rate in Gbit/s (0: unshaped)")
    parser.add_argument("--backend", default="auto", choices=["auto", "numba", "numpy"],
                        help="the codec's CPU backend (auto: Numba, compiled on first use; numpy: the reference)")
    parser.add_argument("--send", metavar="HOST:PORT", help=argparse.SUPPRESS)  # the sender process
    args = parser.parse_args()
    parse_planes(args.planes)  # a bad split fails here, before the sender starts
    if args.send:
        host, port = args.send.rsplit(":", 1)
        send((host, int(port)), args)
        return 0
    return receive(args)


if __name__ == "__main__":
    sys.exit(main())
