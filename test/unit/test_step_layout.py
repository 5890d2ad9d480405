"""`lay_out`, the one layout of every kind of step (scheduler steps, a draft model's, a calibration window),
and the rule that makes it the table's writer: each fed token's slot lands at (its row, its position) and
nothing else of the table moves; lengths and positions follow from the prefix lengths; and in srt nothing but
`ReqToTokenPool.write` stores into `req_to_token`."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.model_executor.forward_batch_info import ForwardMode, FreshTensors, lay_out

SRT = Path(__file__).resolve().parents[2] / "srt"
# The table's one store; every other module goes through it.
WRITER = SRT / "mem_cache" / "memory_pool.py"
IN_PLACE = {"copy_", "index_put_", "index_copy_", "fill_", "zero_", "scatter_", "masked_fill_"}


def pool_with_marks(rows: int = 4, width: int = 16) -> ReqToTokenPool:
    """A pool whose every entry holds a distinct negative mark, so any entry a layout moves shows."""
    pool = ReqToTokenPool(rows, width)
    pool.write((slice(None), slice(None)), -torch.arange(1, rows * width + 1).view(rows, width))
    return pool


def test_an_extend_step_writes_each_fed_slot_at_its_row_and_position_and_nothing_else():
    pool = pool_with_marks()
    before = pool.req_to_token.clone()
    loc = torch.tensor([101, 102, 103, 201, 301, 302])
    batch = lay_out(
        ForwardMode.EXTEND,
        pool,
        [2, 0, 3],
        [0, 5, 7],
        [9, 8, 7, 6, 5, 4],
        [3, 1, 2],
        loc,
        FreshTensors("cpu"),
    )
    assert batch.positions.tolist() == [0, 1, 2, 5, 7, 8]
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu == [3, 6, 9]
    assert batch.extend_prefix_lens_cpu == [0, 5, 7] and batch.extend_seq_lens_cpu == [3, 1, 2]
    assert batch.req_pool_indices.tolist() == [2, 0, 3] and batch.input_ids.tolist() == [9, 8, 7, 6, 5, 4]
    want = before.clone()
    want[2, 0:3] = torch.tensor([101, 102, 103])
    want[0, 5] = 201
    want[3, 7:9] = torch.tensor([301, 302])
    assert torch.equal(pool.req_to_token, want)


def test_decode_rows_may_share_a_request_row_and_read_up_to_their_own_position():
    """A verify step as decode rows: one sequence per fed token, two of them on request row 1."""
    pool = pool_with_marks()
    before = pool.req_to_token.clone()
    loc = torch.tensor([11, 12, 13])
    batch = lay_out(
        ForwardMode.DECODE, pool, [1, 1, 2], [4, 5, 0], [7, 8, 9], [1, 1, 1], loc, FreshTensors("cpu")
    )
    assert batch.batch_size == 3 and batch.extend_seq_lens_cpu is None
    assert batch.seq_lens.tolist() == batch.seq_lens_cpu == [5, 6, 1]
    want = before.clone()
    want[1, 4:6] = torch.tensor([11, 12])
    want[2, 0] = 13
    assert torch.equal(pool.req_to_token, want)


def table_names(tree: ast.AST) -> set[str]:
    """Local names bound to some `*.req_to_token` (`table = pool.req_to_token`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "req_to_token":
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def is_table(node: ast.AST, aliases: set[str]) -> bool:
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr == "req_to_token"
    return isinstance(node, ast.Name) and node.id in aliases


def stores_into_the_table(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    aliases = table_names(tree)
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        lines += [node.lineno for t in targets if isinstance(t, ast.Subscript) and is_table(t, aliases)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in IN_PLACE:
            if is_table(node.func.value, aliases):
                lines.append(node.lineno)
    return lines


def test_the_rule_checker_sees_direct_and_aliased_stores(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "def f(pool, loc):\n"
        "    pool.req_to_token[0, :2] = loc\n"
        "    table = pool.req_to_token\n"
        "    table[1][3] = 0\n"
        "    pool.req_to_token[2].copy_(loc)\n"
        "    x = table[0, :2].clone()\n"
    )
    assert stores_into_the_table(source) == [2, 4, 5]


def test_only_the_pool_writes_req_to_token():
    offenders = {
        str(path.relative_to(SRT.parent)): lines
        for path in sorted(SRT.rglob("*.py"))
        if path != WRITER and (lines := stores_into_the_table(path))
    }
    assert offenders == {}, f"store into req_to_token outside ReqToTokenPool.write: {offenders}"
