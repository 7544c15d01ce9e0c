"""`python -m inference.serve`: an OpenAI-compatible, streaming server for an SPD drafter and its target.

    python -m inference.serve --ckpt drafter/ --port 8000 --simulate
    python -m inference.serve --ckpt drafter/ --target Qwen/Qwen3.5-9B --api-key "$KEY" --device cuda
    python -m inference.serve --ckpt none --target DIR --mode ar --simulate   # the plain target, same API
    # two nodes: node 0 serves HTTP and runs ranks 0..4, node 1 runs ranks 5..8 and serves nothing
    python -m inference.serve --ckpt drafter/ --device cuda --nnodes 2 --node-rank 0 --nproc-per-node 5 --master-addr HOST0
    python -m inference.serve --ckpt drafter/ --device cuda --nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr HOST0

The weights are loaded once, at start: n + 1 rank processes that stay up between requests (in this
process with `--simulate`; `--mode ar` runs the stages in sequence in this process). `--max-batch B` requests
decode at once, each in a slot of the batched pipeline (continuous batching: a request joins a free slot at a
cycle boundary and leaves it when it ends; default 1 on the CPU, up to 8 on GPUs, see `serving.batching`); the
others wait in a FIFO of `--queue-size` (HTTP 429 beyond it). Endpoints: `POST /v1/chat/completions`,
`POST /v1/completions` (`stream: true` for server-sent events as tokens are verified; `temperature`,
`top_p`, `top_k`, `max_tokens`, `seed`, `stop`), `GET /v1/models[/ID]`, `/health` (liveness), `/ready`
(the pipeline can take a request now), `/metrics` (Prometheus, with latency histograms).
The model name is the drafter's directory name (or the target's for `--mode ar`), or `--model-name`.
SIGTERM or Ctrl-C stops the server after the requests in progress (waiting up to `--graceful-timeout`), and
with it the ranks of every node.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import socket
import uuid

import torch

from inference import cli
from inference.backends import make_backend as in_process_backend
from inference.processes.job import DecodeJob
from inference.processes.launch import LaunchError, RankInputError, launch
from inference.processes.nodes import Nodes, RemoteRequestChannel, answer, join_pipeline
from inference.sampling import Sampling
from inference.serving.batching import GPU_BATCH, check_max_batch, default_max_batch
from inference.serving.engine import Engine
from inference.setup import Setup, decode_job, prepare
from spd_lightning.errors import UserError, first_line

DEFAULT_CAP = 1024
DEFAULT_MAX_TOKENS = 256  # a request's max_tokens when it names none (--max-new-tokens)
MIN_GRACE_S, MAX_GRACE_S = 10.0, 120.0  # the default --graceful-timeout's bounds
UNMEASURED_S_PER_TOKEN = 0.25  # before any decode: a slow GPU pipeline's time per token, generously
log = logging.getLogger("inference.serve")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser("python -m inference.serve", __doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("SPD_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/* (default: $SPD_API_KEY; none: open)",
    )
    p.add_argument("--model-name", help="the model id clients use (default: the drafter's or target's directory name)")
    p.add_argument("--queue-size", type=int, default=16, help="requests that may wait; beyond it HTTP 429")
    p.add_argument("--max-tokens-cap", type=int, default=DEFAULT_CAP, help="the largest max_tokens a request may ask")
    p.add_argument(
        "--graceful-timeout",
        type=float,
        help="seconds SIGTERM waits for the requests in progress before it cuts them (503, an SSE error "
        "event on a stream); default: twice the time the tokens they may still ask for take at the rate "
        f"measured so far ({UNMEASURED_S_PER_TOKEN} s per token before the first decode), between "
        f"{MIN_GRACE_S:.0f} and {MAX_GRACE_S:.0f} s",
    )
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request")
    p.add_argument(
        "--max-batch",
        type=int,
        help="requests decoding at once, each in a slot of the batched pipeline (continuous batching); "
        f"default: 1 on the CPU, up to {GPU_BATCH} on GPUs as their memory allows (docs/SERVING.md); "
        "the other nodes take node 0's",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads of the in-process decoder (--simulate, --mode ar); "
        "default: torch's. Tiny models decode fastest with 1",
    )
    cli.add_decoder_arguments(p, max_new_tokens=DEFAULT_MAX_TOKENS, with_ar=True, seed=False)  # requests bring seeds
    p.set_defaults(max_new_tokens=None)  # a request's default max_tokens: DEFAULT_MAX_TOKENS or a lower cap
    add_node_arguments(p)
    return p.parse_args(argv)


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several nodes (inference/processes/nodes.py; the same decoder options on every node)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the ranks run on")
    g.add_argument("--node-rank", type=int, default=0, help="0: this node serves HTTP; others only run ranks")
    g.add_argument("--nproc-per-node", type=int, help="ranks on this node (with --nnodes > 1); in rank order by node")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, reachable from every node")
    g.add_argument("--master-port", type=int, default=29500, help="node 0's port for the ranks' rendezvous")
    g.add_argument("--report-port", type=int, help="node 0's port for the other nodes' reports (default: master + 1)")


def check_args(args: argparse.Namespace) -> None:
    if args.queue_size < 1 or args.max_tokens_cap < 1:
        raise cli.UsageError("--queue-size and --max-tokens-cap must be >= 1")
    if args.max_new_tokens is None:  # not given: 256, or the cap when it is lower
        args.max_new_tokens = min(DEFAULT_MAX_TOKENS, args.max_tokens_cap)
    elif args.max_new_tokens > args.max_tokens_cap:  # given: it was cut to the cap, silently
        raise cli.UsageError(
            f"--max-new-tokens {args.max_new_tokens} (a request's default max_tokens) is above --max-tokens-cap "
            f"{args.max_tokens_cap}: raise --max-tokens-cap or lower --max-new-tokens"
        )
    cli.check_decoder_args(args)
    if not 0 < args.port < 65536:
        raise cli.UsageError(f"--port {args.port} must be in 1..65535")
    if args.threads is not None and args.threads < 1:
        raise cli.UsageError(f"--threads {args.threads} must be >= 1")
    if args.graceful_timeout is not None and not args.graceful_timeout >= 0:
        raise cli.UsageError(f"--graceful-timeout {args.graceful_timeout} must be >= 0 seconds")
    check_node_args(args)


def check_node_args(args: argparse.Namespace) -> None:
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise cli.UsageError(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: need 0 <= node rank < nnodes")
    if args.nnodes == 1:
        return
    if args.simulate:
        raise cli.UsageError("--nnodes > 1 runs the distributed decoder: drop --simulate")
    if args.nproc_per_node is None or args.nproc_per_node < 1:
        raise cli.UsageError("--nnodes > 1 needs --nproc-per-node N >= 1: the ranks this node runs")
    loopback = loopback_name(args.master_addr)
    if loopback is not None:
        raise cli.UsageError(
            f"--master-addr {args.master_addr} resolves to {loopback} (loopback) on this node, which the other nodes "
            "cannot reach: pass node 0's address on the network (e.g. from `hostname -I`)"
        )


def loopback_name(host: str) -> str | None:
    """The loopback address a host NAME resolves to here (many distributions map the machine's own name to
    127.0.1.1), else None. An address literal is meant as written (one machine's rehearsal of several nodes)."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        return address if ipaddress.ip_address(address).is_loopback else None
    except (OSError, ValueError):  # unresolvable here: the connection attempt says so
        return None


def nodes_of(args: argparse.Namespace) -> Nodes | None:
    if args.nnodes == 1:
        return None
    report_port = args.report_port or args.master_port + 1
    return Nodes(args.nnodes, args.node_rank, args.nproc_per_node, args.master_addr, args.master_port, report_port)


def build(args: argparse.Namespace):
    """The app and its engine (weights loaded) for these arguments (checked: `check_args`)."""
    from inference.serving.app import ServerConfig, build_app

    setup = prepared(args)
    name = args.model_name or os.path.basename(os.path.normpath(setup.ckpt or setup.target_path))
    engine = Engine(
        lambda: make_backend(setup, args), setup.tokenizer, setup.mode, args.queue_size, max_batch=args.max_batch
    )
    config = ServerConfig(
        name,
        args.max_tokens_cap,
        args.max_new_tokens,
        setup.info.max_position_embeddings or 0,
        args.api_key,
        args.access_log,
    )
    return build_app(engine, config), engine


def prepared(args: argparse.Namespace) -> Setup:
    """The setup, and `--max-batch` checked against it (its default when not given)."""
    setup = prepare(args)
    if args.nnodes > 1 and setup.mode in ("ar", "eagle3"):  # the mode a drafter (or --ckpt none) implies included
        raise cli.UsageError(
            f"--nnodes > 1 runs the pipeline's ranks; --mode {setup.mode} decodes in one process: use --nnodes 1"
        )
    check_max_batch(args, setup.mode)
    cli.warn_unused_placement(args, setup.mode)
    if args.max_batch is None:
        args.max_batch = default_max_batch(args, setup)
        log.info("--max-batch %d (its default here)", args.max_batch)
    return setup


def make_backend(setup: Setup, args: argparse.Namespace):
    """n + 1 persistent ranks, each request in a slot of their batch (--max-batch B, 1 included); in this process
    the batched simulator with --simulate, and the one-request decoder of --mode ar (the stages in sequence) and
    --mode eagle3 (chain decoding is a one-GPU method: draft and verify in one process)."""
    if args.simulate or setup.mode in ("ar", "eagle3"):
        if args.threads:
            torch.set_num_threads(args.threads)
        if setup.mode in ("ar", "eagle3"):
            return in_process_backend(setup, args.device, compile=args.compile)
        from inference.serving.batch_backend import BatchSimulatorBackend

        return BatchSimulatorBackend.from_setup(setup, args.device, args.max_batch, args.compile)
    from inference.serving.ranks import RankBackend

    return RankBackend(serving_job(setup, args), in_flight=args.max_batch + args.queue_size)


def serving_job(setup: Setup, args: argparse.Namespace) -> DecodeJob:
    """The ranks' job: requests instead of prompts, each cycle's tokens streamed to node 0."""
    job = decode_job(setup, args, [], Sampling(), profile=False)
    job.stream = True
    job.max_batch = args.max_batch
    job.fault = os.environ.get("SPD_FAULT")  # test-only: see `faults.Fault`
    job.nodes = nodes_of(args)
    if job.nodes is not None and job.nodes.node_rank == 0:  # a name of its own for each pipeline (`nodes`)
        job.nodes = dataclasses.replace(job.nodes, pipeline=uuid.uuid4().hex[:12], terms=job.terms())
    return job


def join_next_pipeline(job: DecodeJob, adopt: tuple[str, ...]) -> None:
    """This node's place in node 0's next pipeline, with node 0's terms taken (`adopt`) or refused: either is told
    to node 0 (`nodes.answer`), which starts its ranks once every node joined; a refusal is one line here, and node 0
    logs it and ends that pipeline with it."""
    job.nodes = join_pipeline(job.nodes, job.timeout_s)
    try:
        job.agree(job.nodes.terms, adopt)
    except UserError as e:
        answer(job.nodes, str(e))
        raise
    answer(job.nodes)


def run_ranks_only(args: argparse.Namespace) -> int:
    """A node other than node 0: its share of the ranks, until node 0 stops them (exit 0). When a rank
    fails, node 0 starts a fresh pipeline and this node joins it; it ends when node 0 cannot be reached
    within --timeout, or when its ranks reject their input. It takes node 0's --max-batch unless given its own;
    any other setting the ranks must share differs in one line (`DecodeJob.agree`)."""
    from inference.serving.ranks import serve_requests

    adopt = () if args.max_batch is not None else ("max_batch",)
    job = serving_job(prepared(args), args)
    where = f"node 0 at {args.master_addr}:{args.master_port}"
    while True:
        join_next_pipeline(job, adopt)
        log.info(
            "node %d: %d ranks, joining pipeline %s of %s",
            args.node_rank,
            args.nproc_per_node,
            job.nodes.pipeline,
            where,
        )
        try:
            launch(job, request_channel=RemoteRequestChannel(job.nodes), work=serve_requests)
            return 0
        except RankInputError:
            raise
        except LaunchError as e:
            log.warning("%s; joining the next pipeline", first_line(e))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C (exit 0). The port is taken before the weights load, so a port in use is
    a one-line error at once, not after the loading."""
    import uvicorn

    from inference.serving import logs
    from inference.serving.shutdown import GracefulServer

    logs.configure()
    check_args(args)
    if args.node_rank > 0:
        return run_ranks_only(args)
    with bound_socket(args.host, args.port) as listening:
        app, engine = build(args)
        config = uvicorn.Config(app, log_config=None, log_level="debug" if cli.debugging(args) else "warning")
        host = f"[{args.host}]" if ":" in args.host else args.host
        server = GracefulServer(
            config, lambda: graceful_timeout(args, engine), engine.cut, f"http://{host}:{args.port}"
        )
        try:
            server.run(sockets=[listening])
        finally:
            engine.close()
    return 0


def bound_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise cli.UsageError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port or stop what holds it"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def graceful_timeout(args: argparse.Namespace, engine: Engine) -> float:
    """How long SIGTERM waits for the requests in progress: --graceful-timeout, or twice the time the tokens they
    may still ask for take at the rate measured so far, within [MIN_GRACE_S, MAX_GRACE_S] (docs/SERVING.md,
    "One node", Stopping)."""
    if args.graceful_timeout is not None:
        return args.graceful_timeout
    per_token = engine.seconds_per_token() or UNMEASURED_S_PER_TOKEN
    return min(MAX_GRACE_S, max(MIN_GRACE_S, 2 * engine.tokens_left() * per_token))


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, parse_args, run, lambda args, code: code)
