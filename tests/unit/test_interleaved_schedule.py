"""The interleaved schedule's per-rank compute orders (no process group needed) and its config checks."""

from __future__ import annotations

import itertools

import pytest

from msar_train.parallel.interleaved_schedule import check_feasible, inference_order, train_order


@pytest.mark.parametrize("P,V,M", [(P, V, M) for P, V, M in itertools.product([2, 3, 4], [2, 3, 4], [1, 2, 3, 4, 6, 8])])
def test_train_orders_are_complete_ordered_and_deadlock_free(P, V, M):
    orders = {r: train_order(P, V, M, r) for r in range(P)}
    check_feasible(orders, P, V)
    for r, order in orders.items():
        chunks = [v * P + r for v in range(V)]
        want = {(k, m, c) for k in "FB" for m in range(M) for c in chunks}
        assert len(order) == len(want) and set(order) == want
        pos = {a: i for i, a in enumerate(order)}
        assert all(pos[("F", m, c)] < pos[("B", m, c)] for m in range(M) for c in chunks)
    if M % P == 0 and M > P:  # 1F1B: a rank's backwards start before all its forwards are done
        assert any(order.index(next(a for a in order if a[0] == "B")) < len(order) // 2 for order in orders.values())


@pytest.mark.parametrize("P,V,M", [(2, 2, 1), (2, 2, 3), (4, 2, 5)])
def test_inference_orders_are_deadlock_free(P, V, M):
    orders = {r: inference_order(P, V, M, r) for r in range(P)}
    check_feasible(orders, P, V)


def test_a_deadlocking_order_is_refused():
    P, V, M = 2, 2, 2
    orders = {r: train_order(P, V, M, r) for r in range(P)}
    # rank 1 waits for the gradient of chunk 3 before running chunk 3's forward: nobody can go on
    orders[1] = [("B", 0, 3)] + [a for a in orders[1] if a != ("B", 0, 3)]
    with pytest.raises(RuntimeError, match="deadlock"):
        check_feasible(orders, P, V)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["parallel.virtual_stages=2"], "parallel.virtual_stages"),  # pp_stages=1
        (["parallel=pp2", "parallel.virtual_stages=8", "residual=msar", "residual.n_blocks=4"], "parallel.virtual_stages"),
        (["parallel=pp2", "parallel.virtual_stages=0"], "parallel.virtual_stages"),
    ],
)
def test_bad_virtual_stage_configs_name_the_field(monkeypatch, overrides, field):
    from msar_train.config import compose_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        compose_config(["model=tiny", *overrides])
