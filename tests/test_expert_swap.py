"""Topology-aware expert swap (HierMoE Section IV, moe_compile.swap) under real gloo ranks.

Invariants checked: the model computes the same function before and after any swap (outputs to
1e-6: only the order in which relays add partial outputs changes); every expert's weight, gradient
and optimizer-state rows are identical (sha256) before and after swaps, wherever the expert now
lives, including swaps inside one rank and swaps interrupted by an exception on one rank;
training with swaps gives the losses and final weights of training without (SGD with momentum,
Adam; sharded weights that migrate, and weights every rank holds); on a skewed routing HierD-ES
lowers the counted inter-node bytes.
"""

from __future__ import annotations

import itertools

import pytest
from dist_utils import check_checkpoint, check_optim, run_ranks

from moe_compile.swap.options import DEFAULT_PAYBACK, parse_swap_options
from moe_compile.swap.policy import NO_PAYBACK, SWAPPED

TOL = 1e-5


@pytest.fixture(scope="module")
def invariants() -> list[dict]:
    return run_ranks(4, "invariants", timeout_s=300, worker="swap_worker.py", shape=[2, 2], E=8)


@pytest.mark.ranks
def test_swaps_keep_outputs_and_every_expert(invariants: list[dict]) -> None:
    first = invariants[0]["checks"]
    labels = [c["label"] for c in first]
    assert labels == ["before", "swap 0<->7", "swap 1<->2", "swap 4<->5", "after interrupted swap",
                      "after refused swap", "after recompile"]
    before = first[0]
    assert len(before["sums"]) == 2 * 8  # two layers x eight experts, each held once
    for res in invariants:
        for c in res["checks"]:
            assert c["err"] < 1e-6, f"{c['label']}: output changed by {c['err']}"
            # the expert -> (weights, grads, optimizer state) map is unchanged: nothing lost or mixed
            assert c["sums"] == before["sums"], c["label"]
            assert c["placement"] == next(x for x in first if x["label"] == c["label"])["placement"], \
                "ranks disagree on the placement"
    layer = invariants[0]["layer"]
    place = {c["label"]: c["placement"][layer] for c in first}
    assert place["before"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert place["swap 0<->7"] == [3, 0, 1, 1, 2, 2, 3, 0]  # cross-node
    assert place["swap 1<->2"] == [3, 1, 0, 1, 2, 2, 3, 0]  # same node
    assert place["swap 4<->5"] == place["swap 1<->2"]  # same rank: only the slots trade
    assert place["after interrupted swap"] == place["swap 4<->5"]
    assert place["after refused swap"] == place["swap 4<->5"]
    assert place["after recompile"] == place["swap 4<->5"]


@pytest.mark.ranks
def test_sharded_swaps_move_rows_only_between_the_two_ranks(invariants: list[dict]) -> None:
    # records: (0, 7) between positions 0 and 3, (1, 2) between 0 and 1, (4, 5) inside 2
    moved = [[r["moved_bytes"] for r in res["records"]] for res in invariants]
    assert all(len(m) == 3 for m in moved)
    assert moved[0][0] > 0 and moved[3][0] == moved[0][0] and moved[1][0] == moved[2][0] == 0
    assert moved[0][1] == moved[1][1] > 0 and moved[2][1] == moved[3][1] == 0
    assert all(m[2] == 0 for m in moved)  # same rank: rows trade places, nothing is sent
    for res in invariants:
        assert [tuple(r["ranks"]) for r in res["records"]] == [(0, 3), (0, 1), (2, 2)]


@pytest.mark.ranks
def test_interrupted_and_refused_swaps_raise_on_every_rank(invariants: list[dict]) -> None:
    for rank, res in enumerate(invariants):
        assert len(res["interrupted"]) == 1, f"rank {rank} did not raise for the interrupted swap"
        assert len(res["mismatch"]) == 1, f"rank {rank} did not raise for the mismatched optimizer state"
        assert "differs" in res["mismatch"][0] or "another rank" in res["mismatch"][0], res["mismatch"][0]
    assert any("injected" in res["interrupted"][0] for res in invariants)


@pytest.mark.ranks
def test_backward_refuses_a_placement_swapped_after_its_forward(invariants: list[dict]) -> None:
    for res in invariants:
        assert res["stale_backward"] and "swapped between this forward and its backward" in res["stale_backward"]


@pytest.mark.ranks
def test_explain_shows_swaps_and_placement(invariants: list[dict]) -> None:
    res = invariants[0]
    text = res["explain"]
    assert "expert swaps" in text and "0<->7" in text, text
    layer = res["layer"]
    par = next(p for p in res["explain_parallel"] if p["placement"] == res["checks"][-1]["placement"][layer])
    assert [tuple(s["experts"]) for s in par["swaps"]] == [(0, 7), (1, 2), (4, 5)]
    assert par["swappable"]


@pytest.mark.ranks
def test_two_models_of_one_class_keep_their_own_experts() -> None:
    """Dynamo runs both models on one compiled graph; the backend must map it to each model's
    own shards and placement."""
    results = run_ranks(4, "two_models", timeout_s=300, worker="swap_worker.py", shape=[2, 2], E=8)
    for rank, res in enumerate(results):
        assert max(res["loss_err"]) < TOL, f"rank {rank}: loss differs from the model's own eager loss"
        assert max(res["grad_err"]) < TOL, f"rank {rank}: expert gradients differ from the model's own"
        assert res["layers_a"] and res["layers_b"] and not set(res["layers_a"]) & set(res["layers_b"])
        first_a = next(iter(res["placement_a"].values()))
        assert first_a[0] == 3 and first_a[7] == 0, "model a's swap did not take"
        assert all(p == [0, 0, 1, 1, 2, 2, 3, 3] for p in res["placement_b"].values()), "model b's placement moved"


@pytest.mark.ranks
def test_overlapped_swaps_keep_the_losses() -> None:
    """Overlap mode (collectives in flight across training steps, decisions dropped when a forced
    swap changed the layer's placement meanwhile) trains exactly like eager DDP."""
    results = run_ranks(4, "losses", timeout_s=420, worker="swap_worker.py", shape=[2, 2], E=8, steps=6,
                        kind="grouped_gemm", optimizers=["adam"], modes=["shard"], overlap=True)
    for rank, res in enumerate(results):
        r = res["adam/shard"]
        assert r["decided"] >= 1, f"rank {rank}: no overlapped decision was applied"
        for got, want in zip(r["losses"], r["ref"], strict=True):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank}: loss {got} vs {want} without swaps"
        assert r["weight_err"] < 1e-4, f"rank {rank}: final expert weights differ by {r['weight_err']}"
        assert r["placement"] == results[0]["adam/shard"]["placement"], "ranks disagree on the placement"


@pytest.mark.ranks
def test_overlapped_swap_interrupted_on_one_rank_moves_nothing() -> None:
    """Overlap mode, one side of a decided swap fails after the rows crossed: step() returns on
    every rank and every rank raises at its next forward, where it reads the outcome (the same
    point everywhere, so no rank is left waiting in a collective); placements and every expert's
    rows stay as they were, and training goes on with eager DDP's losses."""
    results = run_ranks(4, "overlap_interrupted", timeout_s=300, worker="swap_worker.py", shape=[2, 2], E=8,
                        steps=6)
    for rank, res in enumerate(results):
        assert [r["at"] for r in res["raised"]] == ["next forward"], f"rank {rank}: {res['raised']}"
    errors = [res["raised"][0]["error"] for res in results]
    assert sum("injected" in e for e in errors) == 1, errors
    assert sum("failed to receive" in e for e in errors) == 1, errors
    assert sum("failed on another rank" in e for e in errors) == 2, errors
    for rank, res in enumerate(results):
        assert res["after"] == res["before"], f"rank {rank}: the failed swap moved or changed something"
        assert res["placement"] == results[0]["placement"], "ranks disagree on the placement"
        for got, want in zip(res["losses"], res["ref"], strict=True):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank}: loss {got} vs {want} without swaps"


@pytest.mark.ranks
@pytest.mark.parametrize("kind", ["grouped_gemm", "expert_loop"])
def test_training_with_swaps_equals_training_without(kind: str) -> None:
    modes = ["shard", "replicated"] if kind == "grouped_gemm" else ["replicated"]
    # SGD (no state to move) and AdamW (its state moves with the experts) on the grouped GEMM's
    # shards and replicas; the expert modules with AdamW
    optimizers = ["sgd", "adam"] if kind == "grouped_gemm" else ["adam"]
    results = run_ranks(4, "losses", timeout_s=420, worker="swap_worker.py", shape=[2, 2], E=8, steps=4,
                        kind=kind, optimizers=optimizers, modes=modes)
    for rank, res in enumerate(results):
        assert sorted(res) == sorted(f"{o}/{m}" for o in optimizers for m in modes)
        for key, r in res.items():
            assert r["swaps"] >= 2, f"{key}: the test must swap (forced swaps every other step)"
            for got, want in zip(r["losses"], r["ref"], strict=True):
                assert abs(got - want) <= TOL * abs(want), f"rank {rank} {key}: loss {got} vs {want} without swaps"
            assert r["weight_err"] < 1e-4, f"rank {rank} {key}: final expert weights differ by {r['weight_err']}"
            assert r["placement"] == results[0][key]["placement"], f"{key}: ranks disagree on the placement"
            if key == "adam/shard":  # rows moved between ranks: the checkpoint puts every expert back in order
                assert any(p != sorted(p) for p in r["placement"].values()), "no expert changed rank"
                check_checkpoint(r["checkpoint"], rank, key)
                check_optim(r["optim"], rank, key)


@pytest.mark.ranks
@pytest.mark.parametrize("overlap", [False, True])
def test_hierd_es_lowers_inter_node_bytes_on_skewed_routing(overlap: bool) -> None:
    """Overlap mode applies a decision two calls after the routing it used: two more steps."""
    results = run_ranks(4, "skewed", timeout_s=240, worker="swap_worker.py", shape=[2, 2], E=8, K=2, H=16, F=24,
                        T=256, steps=6 if overlap else 4, policy="hierd", overlap=overlap)
    for rank, res in enumerate(results):
        assert all(h["err"] < TOL for h in res["history"]), f"rank {rank}: output changed after a swap"
        assert res["placement"] == results[0]["placement"]
    first = [res["history"][0]["inter_bytes"] for res in results]
    last = [res["history"][-1]["inter_bytes"] for res in results]
    swaps = [s for h in results[0]["history"] for s in h.get("swaps", [])]
    print("swaps", swaps, "inter-node bytes per rank", first, "->", last, "placement", results[0]["placement"])
    assert swaps, "HierD-ES made no swap on a routing whose hot experts sit on the other node"
    assert max(last) < max(first), f"busiest rank's inter-node bytes {max(first)} -> {max(last)}"
    assert sum(last) < sum(first), f"total inter-node bytes {sum(first)} -> {sum(last)}"
    if overlap:  # nothing applied before the third call: the first two only gather and decide
        assert not results[0]["history"][0]["swaps"] and not results[0]["history"][1]["swaps"]


@pytest.mark.ranks
def test_hysteresis_keeps_a_pair_from_swapping_back() -> None:
    """Each node's tokens prefer expert 0 on one step and expert 4 on the next (K = 1): HierD-ES
    on each step's routing alone swaps a pair and swaps it back at the next call, paying two
    migrations for nothing (``hysteresis: 0``, the paper's rule). With the default hysteresis no
    pair is swapped again within 10 calls."""
    from moe_compile.swap.options import DEFAULT_HYSTERESIS

    runs = {}
    for hysteresis in (0, DEFAULT_HYSTERESIS):
        results = run_ranks(4, "skewed", timeout_s=240, worker="swap_worker.py", shape=[2, 2], E=8, K=1, H=16, F=24,
                            T=64, steps=6, policy="hierd", alternate=True, hysteresis=hysteresis)
        for res in results:
            assert all(h["err"] < TOL for h in res["history"]), "output changed after a swap"
            assert res["placement"] == results[0]["placement"] and res["decisions"] == results[0]["decisions"]
        runs[hysteresis] = results[0]
    pairs = {h: [tuple(p) for rec in r["history"] for p in rec.get("swaps", [])] for h, r in runs.items()}
    calls = {h: [(i + 1, tuple(p)) for i, rec in enumerate(r["history"]) for p in rec.get("swaps", [])]
             for h, r in runs.items()}
    assert len(set(pairs[0])) < len(pairs[0]), f"the case must make the paper's rule swap a pair back: {calls[0]}"
    for (c1, p1), (c2, p2) in itertools.combinations(calls[DEFAULT_HYSTERESIS], 2):
        assert p1 != p2, f"pair {p1} swapped at calls {c1} and {c2}: {calls[DEFAULT_HYSTERESIS]}"


def test_smart_matrix_matches_brute_force() -> None:
    """SmartMoE-style objective: the busiest rank's raw (not deduplicated) token count after
    each swap, against recounting every swapped placement."""
    import numpy as np

    from moe_compile.swap.policy import smart_matrix

    rng = np.random.default_rng(0)
    num_experts = 12
    for world in (1, 2, 4, 4):
        topk = np.stack([rng.choice(num_experts, 3, replace=False, p=rng.dirichlet(np.ones(num_experts)))
                         for _ in range(200)])
        placement = rng.permutation(np.arange(num_experts) % world)
        q = smart_matrix(topk, num_experts, placement, world)
        for a in range(num_experts):
            for b in range(num_experts):
                swapped = placement.copy()
                swapped[[a, b]] = swapped[[b, a]]
                want = np.bincount(swapped[topk.ravel()], minlength=world).max()
                assert q[a, b] == want, (a, b)


@pytest.mark.parametrize(("raw", "message"), [
    ({"every": 0}, "'every' must be a positive int"),
    ({"threshold": 1.5}, "'threshold' must be a fraction"),
    ({"kind": "mean"}, "'kind' must be one of"),
    ({"gamma": -1}, "'gamma' must be a positive number"),
    ({"policy": "random"}, "'policy' must be one of"),
    ({"overlap": 1}, "'overlap' must be True or False"),
    ({"payback": -1}, "'payback' must be a number of training steps"),
    ({"payback": float("inf")}, "'payback' must be a number of training steps"),
    ({"evry": 1}, "unknown expert_swap setting"),
    ("yes", "must be True or a dict"),
])
def test_bad_swap_options_say_what_to_change(raw: object, message: str) -> None:
    from moe_compile.swap.options import parse_swap_options

    with pytest.raises(ValueError, match=message):
        parse_swap_options(raw)


def test_payback_rule_is_on_by_default_and_zero_turns_it_off() -> None:
    assert DEFAULT_PAYBACK == 10
    for raw in (True, {"every": 1}):
        opts = parse_swap_options(raw)
        assert opts is not None and opts.payback == DEFAULT_PAYBACK
    off = parse_swap_options({"payback": 0})
    assert off is not None and off.payback == 0


def test_expert_swap_needs_a_mesh() -> None:
    from moe_compile.options import parse_options

    with pytest.raises(ValueError, match="give a mesh"):
        parse_options({"expert_swap": {"every": 1}})
    assert parse_options({"expert_swap": False}).expert_swap is None


@pytest.mark.ranks
def test_migrate_fits_the_announced_bound_in_one_round() -> None:
    """A swap's two ranks move [signature | rows] in one exchange when the announced bound holds
    both messages, in two (the header, then the rows) when it does not (no bound, or one side
    outgrew it), and refuse alike on both sides when their layouts differ: each side receives
    exactly the other side's rows and keeps its own to put back."""
    results = run_ranks(2, "migrate_bounds", timeout_s=240, worker="swap_worker.py", shape=[2], E=4)
    for rank, res in enumerate(results):
        full = res["full"]
        for label, rounds in (("no_bound", 2), ("announced", 1), ("roomy", 1), ("short_both", 2)):
            r = res[label]
            assert r["error"] is None, f"rank {rank}, {label}: {r['error']}"
            assert r["rounds"] == rounds, f"rank {rank}, {label}: {r['calls']}"
            assert r["matches_peer"] and r["undo_is_mine"], f"rank {rank}, {label}: rows differ"
        assert res["announced"]["calls"] == [[full, full]], res["announced"]["calls"]
        r = res["layouts_differ"]
        assert res["sizes_differ"][0] > res["sizes_differ"][1], res["sizes_differ"]
        assert r["rounds"] == 2 and "hold different things" in (r["error"] or ""), f"rank {rank}: {r}"


@pytest.mark.ranks
def test_payback_rule_keeps_only_swaps_that_repay_their_migration() -> None:
    """Without the rule HierD-ES swaps on this routing; each swap's predicted migration time is the
    alpha-beta time of one expert's rows over the slowest link between its two ranks. A payback
    of 1e-9 steps (no saving repays any migration) stops every swap; a huge one keeps those whose
    plain-max time drops. With 1e-9 the ranks see that from the forward's gathered statistics
    (checked equal to those of every rank's routing with its source) and send no routing, and
    after the first call no message at all, but for the periodic announcement of the sizes."""
    results = run_ranks(4, "payback", timeout_s=300, worker="swap_worker.py", shape=[2, 2], E=8, steps=4,
                        paybacks=[0.0, 1e-9, 1e12, 1e-9], overlaps=[False, False, False, True])
    for rank, res in enumerate(results):
        # the runtime's statistics of each forward are those of every rank's routing together
        assert res["stats_err"] == 0.0, f"rank {rank}: gathered statistics differ: {res['stats_err']}"
        # the per-expert counts the payback bound asks for, from the forward after its first call on
        assert res["experts_checked"] >= 3 * 2 * 3, f"rank {rank}: {res['experts_checked']}"
        free, tight, loose = res["0.0"], res["1e-09"], res["1000000000000.0"]
        # the messages each call posted: the decider of each layer's routing, [] for one without
        # routing (decisions, outcomes); the first call's routing goes twice (its capacity grows)
        for key in ("messages 0.0", "messages 1000000000000.0"):
            assert all(call[0] == [0, 1] for call in res[key]), f"rank {rank}: {res[key]}"
        # no saving repays anything: once the sizes are announced (the first call), every rank sees
        # from the forward's statistics that no layer's routing is needed, and nothing is exchanged
        tight_msgs = res["messages 1e-09"]
        assert tight_msgs[0][:2] == [[0, 1], [0, 1]] and tight_msgs[1:] == [[], [], []], f"rank {rank}: {tight_msgs}"
        # overlap mode: the first call posts its routing (no room: the next round would have it),
        # the second reads the sizes; the third announces them again (ANNOUNCE_EVERY 2 here), with
        # no routing; the fourth posts nothing
        assert res["messages 1e-09 overlap"] == [[[0, 1]], [], [[]], []], \
            f"rank {rank}: {res['messages 1e-09 overlap']}"
        assert res["1e-09 overlap"] == []
        assert free, f"rank {rank}: HierD-ES made no swap without the rule; the test needs one"
        for s in free:
            assert s["migration_s"] == pytest.approx(s["expected_s"], rel=1e-9), f"rank {rank}: {s}"
            # the smooth max may improve while the busiest destination stays (saved 0), never worse
            assert s["saved_s"] >= 0, f"rank {rank}: a swap the plain max predicts slower: {s}"
        assert tight == [], f"rank {rank}: swaps whose saving cannot repay their migration: {tight}"
        # every decision is counted on every rank alike, with its outcome: a swap or why none
        for key, made in (("0.0", free), ("1e-09", tight), ("1000000000000.0", loose)):
            decisions = res[f"decisions {key}"]
            assert decisions == results[0][f"decisions {key}"], f"rank {rank}: ranks disagree on {key}"
            assert all(sum(d.values()) == 4 for d in decisions.values()), f"rank {rank} {key}: {decisions}"
            assert sum(d.get(SWAPPED, 0) for d in decisions.values()) == len(made), f"rank {rank} {key}: {decisions}"
        assert all(d == {NO_PAYBACK: 4} for d in res["decisions 1e-09"].values()), res["decisions 1e-09"]
        overlapped = res["decisions 1e-09 overlap"]
        assert all(set(d) == {NO_PAYBACK} and d[NO_PAYBACK] >= 3 for d in overlapped.values()), overlapped
        # explain (a recompile keeps the layers) shows them
        assert res["explain decisions 1e-09"] == list(res["decisions 1e-09"].values())
        assert "expert swap decisions" in res["explain 1e-09"] and "repays its migration" in res["explain 1e-09"]
        # any positive saving repays in 1e12 steps; a swap that only improves the smooth max does not
        assert loose and all(s["saved_s"] > 0 for s in loose), f"rank {rank}: {loose}"
