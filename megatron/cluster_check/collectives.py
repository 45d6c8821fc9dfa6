"""Section 2, collectives: do all-reduce, all-gather and reduce-scatter give the right values, how fast are they
over the world, within each node and across nodes, what does a small message cost, and which rank is slow.

Bandwidth is nccl-tests' bus bandwidth (its doc/PERFORMANCE.md): for a buffer of S bytes (the all-reduce's
tensor, the all-gather's output, the reduce-scatter's input) taking t seconds on n ranks, algbw = S / t and

    busbw = algbw · 2(n−1)/n  (all-reduce)        busbw = algbw · (n−1)/n  (all-gather, reduce-scatter)

which is the bandwidth each rank's link sustains, comparable across n and with the hardware's figure. The time
of a size is the slowest rank's mean over the timed iterations. Sizes run from 1 MiB to 1 GiB on accelerators;
CPU processes (gloo) stop at 16 MiB. The values are checked on a small buffer first, and again after each size's
timed runs (NCCL picks its protocol and algorithm by size). A group's members are in its rank order, which
new_group sorts. Stragglers: every rank times the same matrix multiply alone on its device
(on a CPU one rank after another, as the ranks share the host's cores); a rank above STRAGGLER x the median is
named. `cluster_check_busbw_floor` (GB/s) fails any measured group whose bus bandwidth at the largest size is
below it. A world of one rank has no link: its collectives are checked for their values only.

facts: `correct` (every collective gave the right values on every rank: the sections that train can run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron.cluster_check.context import CheckContext
from megatron.cluster_check.ranks import gather
from megatron.cluster_check.report import SectionResult

NAME = "collectives"
OPS = ("all-reduce", "all-gather", "reduce-scatter")
MIB = 2**20
DEVICE_SIZES = tuple(MIB * 4**i for i in range(6))  # 1 MiB .. 1 GiB
CPU_SIZES = (MIB, 4 * MIB, 16 * MIB)
STRAGGLER = 1.5
LATENCY_ITERATIONS = 50


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth."""
    return 2 * (n - 1) / n if op == "all-reduce" else (n - 1) / n


def _operation(op: str, elements: int, n: int, device: torch.device, rank_value: float,
               group) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
    """(run it once, its output) for `op` on a buffer of `elements` fp32 values; inputs hold `rank_value`."""
    if op == "all-reduce":
        buffer = torch.empty(elements, device=device)

        def run() -> None:
            buffer.fill_(rank_value)
            dist.all_reduce(buffer, group=group)
        return run, lambda: buffer
    if op == "all-gather":
        part, whole = torch.full((elements // n,), rank_value, device=device), torch.empty(elements, device=device)
        return lambda: dist.all_gather_into_tensor(whole, part, group=group), lambda: whole
    whole, part = torch.full((elements,), rank_value, device=device), torch.empty(elements // n, device=device)
    return lambda: dist.reduce_scatter_tensor(part, whole, group=group), lambda: part


def _holds_expected(op: str, members: list[int], output: torch.Tensor) -> bool:
    """Whether `op`'s output is what it must be when rank r contributes r + 1 everywhere: the sum over the
    members, or (all-gather) each member's value in its block, in the group's rank order. Compared in place (no
    copy of a 1 GiB buffer); exact, as sums of small integers are in fp32."""
    if op == "all-gather":
        values = torch.tensor([r + 1.0 for r in members], device=output.device)
        return bool(torch.equal(output.view(len(members), -1), values[:, None].expand(len(members),
                                                                                        output.numel() // len(members))))
    return bool((output == float(sum(r + 1 for r in members))).all())


class Groups:
    """The groups measured, the same kinds on every rank: the world; where the world spans nodes that hold as many
    ranks each, this rank's node (if that is more than one rank) and, across nodes, the ranks of this rank's
    local index."""

    def __init__(self, context: CheckContext):
        """Each group's members in its own rank order, which new_group sorts: across nodes, a placement such as
        ranks 0 and 3 on one node and 1 and 2 on the other gives the group of local index 1 as [2, 3]."""
        ranks, rank = context.ranks, dist.get_rank()
        hosts = ranks.hosts()
        self.kinds: dict[str, tuple[object, list[int]]] = {"world": (None, list(range(ranks.world_size)))}
        per_host = {len(ranks.on_host(h)) for h in hosts}
        if len(hosts) == 1 or len(per_host) > 1:
            return
        local_ranks = per_host.pop()
        if local_ranks > 1:
            for host in hosts:  # new_group is collective: every rank creates every group, in one order
                group = dist.new_group(ranks.on_host(host))
                if rank in ranks.on_host(host):
                    self.kinds["within a node"] = (group, ranks.on_host(host))
        for local in range(local_ranks):
            members = sorted(ranks.on_host(h)[local] for h in hosts)
            group = dist.new_group(members)
            if rank in members:
                self.kinds["across nodes"] = (group, members)


def _correct(result: SectionResult, context: CheckContext, groups: Groups) -> bool:
    """The values of every collective of every group on a small buffer, before any is timed."""
    rank, problems = dist.get_rank(), []
    for kind, (group, members) in groups.kinds.items():
        for op in OPS:
            run, output = _operation(op, 1024 * len(members), len(members), context.device, rank + 1.0, group)
            run()
            if not _holds_expected(op, members, output()):
                problems.append(f"{op} {kind}")
    return _judge(result, context, problems)


def _judge(result: SectionResult, context: CheckContext, problems: list[str]) -> bool:
    """Collective: every rank's wrong collectives gathered; each rank that saw any is a finding."""
    wrong = gather(problems)
    for other, found in enumerate(wrong):
        if found:
            result.fail(context.ranks.who(other), f"wrong values from {', '.join(found)}",
                        "a broken communication library or device: run nccl-tests on that node, check its NCCL "
                        "and driver versions (environment section), and NCCL_DEBUG=INFO's output")
    return not any(wrong)


def _synchronize() -> None:
    get_accelerator().synchronize()


def _seconds_per_run(run: Callable[[], None], warmup: int, iterations: int) -> float:
    for _ in range(warmup):
        run()
    _synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    _synchronize()
    return (time.perf_counter() - start) / iterations


def _bandwidths(context: CheckContext, groups: Groups) -> tuple[dict[str, dict[str, dict[int, list[float]]]],
                                                                 list[str]]:
    """(kind -> op -> size -> the bus bandwidth (GB/s) each rank's group reached, in rank order (all ranks of a
    group share its figure: the slowest member's time); the collectives whose values were wrong on this rank after
    the timed runs, with their size: NCCL changes protocol and algorithm with the size, so each is checked)."""
    sizes = CPU_SIZES if context.on_cpu else DEVICE_SIZES
    figures: dict[str, dict[str, dict[int, list[float]]]] = {}
    wrong: list[str] = []
    for kind, (group, members) in groups.kinds.items():
        n = len(members)
        for op in OPS:
            for size in sizes:
                elements = size // 4 // n * n
                run, output = _operation(op, elements, n, context.device, dist.get_rank() + 1.0, group)
                iterations = 3 if context.on_cpu else (10 if size <= 64 * MIB else 4)
                seconds = _seconds_per_run(run, 1 if context.on_cpu else 2, iterations)
                if not _holds_expected(op, members, output()):
                    wrong.append(f"{op} {kind} at {size // MIB} MiB")
                slowest = torch.tensor([seconds], device=context.device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                busbw = elements * 4 / slowest.item() * bus_factor(op, n) / 1e9
                figures.setdefault(kind, {}).setdefault(op, {})[size] = gather(busbw)
    return figures, wrong


def _latency_us(context: CheckContext) -> float:
    """The median time of a 4-byte all-reduce over the world, as the slowest rank saw it."""
    value = torch.zeros(1, device=context.device)
    times = []
    for iteration in range(LATENCY_ITERATIONS + 5):
        _synchronize()
        start = time.perf_counter()
        dist.all_reduce(value)
        _synchronize()
        if iteration >= 5:
            times.append(time.perf_counter() - start)
    return max(gather(statistics.median(times))) * 1e6


def _gemm_seconds(context: CheckContext) -> list[float]:
    """Each rank's best time of one matrix multiply on its own device, in rank order."""
    size, dtype = (512, torch.float32) if context.on_cpu else (8192, torch.bfloat16)
    a, b = (torch.randn(size, size, device=context.device, dtype=dtype) for _ in range(2))

    def best() -> float:
        return min(_seconds_per_run(lambda: a @ b, 1, 1) for _ in range(9))

    if not context.on_cpu:
        return gather(best())
    mine = None
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            mine = best()
        dist.barrier()
    return gather(mine)


def _group_name(context: CheckContext, kind: str, members: list[int]) -> str:
    """The world and a node by their hosts; a group across nodes by its ranks (one per node)."""
    if kind == "across nodes":
        return context.ranks.name(members)
    return ", ".join(dict.fromkeys(context.ranks.hosts_by_rank[r] for r in members))


def _floor(result: SectionResult, context: CheckContext, groups: Groups, figures: dict, floor: float) -> None:
    """Every group whose bus bandwidth at the largest size is below `floor` GB/s, named by its hosts."""
    members_by_kind = {kind: gather(members) for kind, (_, members) in groups.kinds.items() if kind != "world"}
    members_by_kind["world"] = [groups.kinds["world"][1]] * context.ranks.world_size
    within = "check the node's device links (nvidia-smi topo -m; NCCL_P2P_DISABLE must not be set)"
    fixes = {"world": within if len(context.ranks.hosts()) == 1 else
             "the within-a-node and across-nodes figures show which part is slow",
             "within a node": within,
             "across nodes": "check the network between these nodes: NCCL_DEBUG=INFO shows the transport (NET/IB "
                             "expected, not NET/Socket), ibstat the links"}
    if context.on_cpu:
        fixes = dict.fromkeys(fixes, "CPU processes talk through gloo, far below any GPU link: set the floor for the "
                                     "accelerators' NCCL, or leave cluster_check_busbw_floor unset here")
    for kind, by_op in figures.items():
        for op, by_size in by_op.items():
            size = max(by_size)
            seen: set[tuple[int, ...]] = set()
            for rank, busbw in enumerate(by_size[size]):
                members = tuple(members_by_kind[kind][rank])
                if members in seen or busbw >= floor:
                    continue
                seen.add(members)
                result.fail(f"{op} {kind} ({_group_name(context, kind, list(members))})",
                            f"{busbw:.2f} GB/s bus bandwidth at {size // MIB} MiB, below the floor "
                            f"cluster_check_busbw_floor = {floor:g} GB/s", fixes[kind])


def run(context: CheckContext) -> SectionResult:
    result = SectionResult(NAME)
    groups = Groups(context)
    correct = _correct(result, context, groups)
    result.facts = {"correct": correct}
    if not correct:
        result.summary = "wrong values: bandwidth not measured"
        return result
    if context.ranks.world_size == 1:
        result.summary = "one rank: the values are right; bandwidth and latency not applicable (no link to measure)"
        result.figures = ["One rank: the collectives are checked for their values only; without another rank there "
                          "is no link whose bandwidth or latency could be measured"
                          + ("; cluster_check_busbw_floor is not applied." if context.cfg.cluster_check_busbw_floor
                             is not None else ".")]
        return result
    figures, wrong = _bandwidths(context, groups)
    if not _judge(result, context, wrong):
        result.facts["correct"] = False
        result.summary = "wrong values at a bandwidth size: bandwidth not reported"
        return result
    latency = _latency_us(context)
    gemm = _gemm_seconds(context)
    get_accelerator().empty_cache()  # the GiB buffers: the sections that train measure their own peak
    median = statistics.median(gemm)
    for rank, seconds in enumerate(gemm):
        if seconds > STRAGGLER * median:
            result.fail(context.ranks.who(rank), f"a matrix multiply takes {seconds / median:.1f} x the median "
                        f"rank's time ({seconds * 1e3:.2f} ms against {median * 1e3:.2f} ms)",
                        f"a throttled or faulty device, or other work on {context.ranks.hosts_by_rank[rank]} "
                        "(nvidia-smi -q -d PERFORMANCE,TEMPERATURE; top)")
    floor = context.cfg.cluster_check_busbw_floor
    if floor is not None:
        _floor(result, context, groups, figures, floor)
    sizes = sorted(next(iter(next(iter(figures.values())).values())))
    header = " | ".join(f"{s // MIB} MiB" for s in sizes)
    result.figures = [f"Bus bandwidth, GB/s (nccl-tests' busbw; the slowest group where several are measured "
                      f"at once){'; CPU processes: sizes up to 16 MiB' if context.on_cpu else ''}:", "",
                      f"| group | operation | {header} |", "|---|---|" + "---|" * len(sizes)]
    for kind, by_op in figures.items():
        for op, by_size in by_op.items():
            result.figures.append(f"| {kind} | {op} | " + " | ".join(f"{min(by_size[s]):.2f}" for s in sizes) + " |")
    if len(context.ranks.hosts()) == 1:
        result.figures += ["", "One node: the world is the node; nothing across nodes to measure."]
    elif len(groups.kinds) == 1:
        result.figures += ["", "The nodes hold different numbers of ranks: only the world is measured."]
    slowest = max(range(len(gemm)), key=gemm.__getitem__)
    result.figures += ["", f"Small-message latency (4-byte all-reduce over the world, median): {latency:.0f} µs.",
                       f"Matrix multiply per rank: median {median * 1e3:.2f} ms, slowest {context.ranks.who(slowest)} "
                       f"{gemm[slowest] * 1e3:.2f} ms ({gemm[slowest] / median:.2f} x; straggler above {STRAGGLER} x)."]
    largest = max(sizes)
    world = min(figures["world"]["all-reduce"][largest])
    result.summary = (f"all-reduce over the world {world:.2f} GB/s busbw at {largest // MIB} MiB, latency "
                      f"{latency:.0f} µs, slowest rank {gemm[slowest] / median:.2f} x the median"
                      + ("" if floor is None else f", floor {floor:g} GB/s"))
    return result
