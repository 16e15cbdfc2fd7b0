"""Rule registry: every op kind against hand-written factor expectations, plus explicit rules."""

from __future__ import annotations

import math
import re

import pytest
from shardplan.ir import Graph, Origin, ShardingRule, TensorType, UnsupportedOpWarning
from shardplan.ir.registry import core_kinds, rule_for
from shardplan.ir.verify import verify

Case = tuple[list[str], list[str], dict]

EW = [(["f32[]"], ["f32[]"], {}), (["f32[1,7]"], ["f32[1,7]"], {})]
EW_BINARY = [(["f32[3,1,5]", "f32[5]"], ["f32[3,1,5]"], {})]
REDUCE = [
    (["f32[3,5]"], ["f32[3]"], {"axes": (1,)}),
    (["f32[7]"], ["f32[]"], {"axes": (0,)}),
    (["f32[3,1,5]"], ["f32[1,1,1]"], {"axes": (0, 2)}),
    (["f32[]"], ["f32[]"], {"axes": ()}),
]
ROW = [(["f32[3,5]"], ["f32[3,5]"], {"axis": 1}), (["f32[1,7]"], ["f32[1,7]"], {"axis": 1})]
NORM = [
    (["f32[3,5]", "f32[5]", "f32[5]"], ["f32[3,5]", "f32[3]", "f32[3]"], {"axis": 1}),
    (["f32[4,4]", "f32[4]"], ["f32[4,4]"], {"axis": 1}),  # square: the weight is still trailing
]
NORM_BACKWARD = [
    (["f32[3,5]", "f32[3,5]", "f32[3]", "f32[3]", "f32[5]"], ["f32[3,5]", "f32[5]"], {"axis": 1})
]
LOSS = [
    (["f32[3,5]", "i64[3]"], ["f32[]"], {"axis": 1}),
    (["f32[2,3,7]", "i64[2,3]"], ["f32[]"], {"axis": 2}),
]
LOSS_BACKWARD = [(["f32[]", "f32[3,5]", "i64[3]"], ["f32[3,5]"], {"axis": 1})]
RESHAPE = [
    (["f32[8,4]"], ["f32[2,16]"], {}),
    (["f32[15]"], ["f32[3,5]"], {}),
    (["f32[2,3]"], ["f32[3,2]"], {}),
    (["f32[3,5]"], ["f32[5,3]"], {}),
    (["f32[1,15]"], ["f32[15,1]"], {}),
    (["f32[]"], ["f32[1,1]"], {}),
]
BROADCAST = [
    (["f32[5]"], ["f32[3,5]"], {"dims": (1,)}),
    (["f32[1,5]"], ["f32[3,5]"], {"dims": (0, 1)}),
    (["f32[]"], ["f32[3]"], {"dims": ()}),
]
ATTENTION = [
    (["f32[2,4,8,16]"] * 3, ["f32[2,4,8,16]"], {}),
    (["f32[1,3,5,7]", "f32[1,3,9,7]", "f32[1,3,9,11]"], ["f32[1,3,5,11]", "f32[1,3,5]"], {}),
]
ATTENTION_BACKWARD = [
    (
        ["f32[1,3,5,11]", "f32[1,3,5,7]", "f32[1,3,9,7]", "f32[1,3,9,11]", "f32[1,3,5,11]",
         "f32[1,3,5]"],
        ["f32[1,3,5,7]", "f32[1,3,9,7]", "f32[1,3,9,11]"],
        {},
    )
]  # fmt: skip

SPECIAL: dict[str, list[Case]] = {
    "argmax": [(["f32[3,5]"], ["i64[3]"], {"axes": (1,)})],
    "attention": ATTENTION,
    "attention_backward": ATTENTION_BACKWARD,
    "broadcast": BROADCAST,
    "broadcast_in_dim": BROADCAST,
    "concat": [(["f32[3,5]", "f32[2,5]"], ["f32[5,5]"], {})],
    "constant": [([], ["f32[]"], {}), ([], ["f32[3,1]"], {})],
    "cross_entropy": LOSS,
    "cross_entropy_backward": LOSS_BACKWARD,
    "dot": [(["f32[16,64]", "f32[64,256]"], ["f32[16,256]"], {}),
            (["f32[1,7]", "f32[7,1]"], ["f32[1,1]"], {})],
    "dot_general": [(["f32[2,3,5]", "f32[2,5,7]"], ["f32[2,3,7]"],
                     {"lhs_batch": (0,), "rhs_batch": (0,), "lhs_contracting": (2,),
                      "rhs_contracting": (1,)})],
    "dynamic_slice": [(["f32[8,5]", "i64[]", "i64[]"], ["f32[4,5]"], {})],
    "einsum": [(["f32[2,3,5]", "f32[5,7]"], ["f32[2,3,7]"], {"equation": "bsh,hf->bsf"})],
    "embedding": [(["f32[100,16]", "i64[2,8]"], ["f32[2,8,16]"], {}),
                  (["f32[100,16]", "i64[]"], ["f32[16]"], {})],
    "embedding_backward": [(["f32[2,8,16]", "i64[2,8]"], ["f32[100,16]"], {})],
    "gather": [(["f32[10,4]", "i64[3]"], ["f32[3,4]"], {})],
    "index_copy": [(["f32[4,2,16,8]", "i64[1]", "f32[4,2,1,8]"], ["f32[4,2,16,8]"], {"dim": 2})],
    "iota": [([], ["i32[3,5]"], {})],
    "layer_norm": NORM,
    "layer_norm_backward": NORM_BACKWARD,
    "matmul": [(["f32[2,3,5]", "f32[5,7]"], ["f32[2,3,7]"], {}),
               (["f32[5]", "f32[5,7]"], ["f32[7]"], {}),
               (["f32[3,5]", "f32[5]"], ["f32[3]"], {}),
               (["f32[2,1,3,5]", "f32[4,5,7]"], ["f32[2,4,3,7]"], {})],
    "nll_loss": LOSS,
    "nll_loss_backward": LOSS_BACKWARD,
    "pad": [(["f32[3,5]"], ["f32[5,5]"], {})],
    "reshape": RESHAPE,
    "rms_norm": [(["f32[3,5]", "f32[5]"], ["f32[3,5]"], {"axis": 1}), NORM[1]],
    "rms_norm_backward": NORM_BACKWARD,
    "scan_carry": [(["f32[3,5]"], ["f32[3,5]"], {})],
    "scan_index": [(["f32[4,3,5]"], ["f32[3,5]"], {})],
    "scan_loop": [(["f32[3,5]"], ["f32[3,5]"], {"carry": "c"})],
    "scan_stack": [(["f32[3,5]"], ["f32[4,3,5]"], {})],
    "slice": [(["f32[8,5]"], ["f32[4,5]"], {}), (["f32[7]"], ["f32[1]"], {})],
    "topk": [(["f32[3,5]"], ["f32[3,5]", "i64[3,5]"], {"axis": 1})],
    "transpose": [(["f32[3,5,7]"], ["f32[7,3,5]"], {"perm": (2, 0, 1)}),
                  (["f32[]"], ["f32[]"], {"perm": ()})],
}  # fmt: skip
for _kind in ("reduce_sum", "sum", "mean", "reduce_mean", "reduce_max", "reduce_min"):
    SPECIAL[_kind] = REDUCE
for _kind in ("max_reduce", "amax", "amin"):
    SPECIAL[_kind] = REDUCE[:1]
SPECIAL["argmin"] = SPECIAL["argmax"]
for _kind in ("softmax", "log_softmax", "cumsum", "sort"):
    SPECIAL[_kind] = ROW
for _kind in ("softmax_backward", "log_softmax_backward"):
    SPECIAL[_kind] = [(["f32[3,5]", "f32[3,5]"], ["f32[3,5]"], {"axis": 1})]


def tensor(text: str) -> TensorType:
    match = re.fullmatch(r"(\w+)\[([\d,]*)\]", text)
    assert match, text
    dims = tuple(int(d) for d in match.group(2).split(",") if d)
    return TensorType(dims, match.group(1))


def cases(kind: str) -> list[Case]:
    """The golden cases of one kind; elementwise kinds get scalar, size-1 and broadcast cases."""
    return SPECIAL.get(kind, EW + EW_BINARY)


def case_line(kind: str, case: Case) -> str:
    ins, outs, attrs = case
    rule = rule_for(kind, [tensor(t) for t in ins], [tensor(t) for t in outs], attrs)
    suffix = f" {attrs}" if attrs else ""
    return f"{kind}({', '.join(ins)}) -> ({', '.join(outs)}){suffix}: {rule}"


# -- hand-written expectations ------------------------------------------------------------------
# One line per case of ``cases(kind)``, derived by hand from what each op computes (not from the
# registry's output): ``spec`` in any factor letters, then the factors that may not be split
# (``need=``) and those whose split leaves a pending result (``red=``). Factor names are compared
# up to renaming; sizes follow from the shapes.
ELEMENTWISE_HAND = ["->", "ab->ab", "abc,c->abc"]  # scalar, size-1 dim, trailing broadcast
REDUCE_HAND = ["ab->a red=b", "a-> red=a", "abc->1b1 red=ac", "->"]
ROW_HAND = ["ab->ab need=b"] * 2  # the row (axis 1) is read whole
NORM_HAND = ["ab,b,b->ab,a,a need=b", "ab,b->ab need=b"]  # statistics over the hidden dim
NORM_BACKWARD_HAND = ["ab,ab,a,a,b->ab,b need=b sum=a:1"]  # the weight gradient sums the rows
LOSS_HAND = ["ab,a-> red=a need=b", "abc,ab-> red=ab need=c"]  # a mean over tokens; vocab whole
LOSS_BACKWARD_HAND = [",ab,a->ab need=b"]
BROADCAST_HAND = ["b->ab", "1b->ab", "->a"]
HAND: dict[str, list[str]] = {
    "argmax": ["ab->a need=b"],  # an index: a pending max of indices means nothing
    "argmin": ["ab->a need=b"],
    "attention": [
        "bhsd,bhtd,bhte->bhse need=dt",  # batch, heads and queries split; keys and head dim whole
        "bhsd,bhtd,bhte->bhse,bhs need=dt",  # and the log-sum-exp per query
    ],
    # dK and dV sum over queries while dQ keeps them: no one factor kind fits s, so it is whole
    # queries split too (context parallelism): dQ rows are final, dK/dV are each rank's share of
    # a sum over queries, so s is summed into results 1 and 2; keys and head dims stay whole
    "attention_backward": ["bhse,bhsd,bhtd,bhte,bhse,bhs->bhsd,bhtd,bhte need=det sum=s:12"],
    "broadcast": BROADCAST_HAND,
    "broadcast_in_dim": BROADCAST_HAND,
    "concat": ["ab,cb->eb need=ac"],  # the joined dim is whole in the operands
    "constant": ["->", "->ab"],
    "cross_entropy": LOSS_HAND,
    "cross_entropy_backward": LOSS_BACKWARD_HAND,
    "cumsum": ROW_HAND,
    "dot": ["ik,kj->ij red=k", "ik,kj->ij red=k"],
    "dot_general": ["bik,bkj->bij red=k"],
    "dynamic_slice": ["ab,,->cb need=a"],  # the sliced dim is read at a runtime offset
    "einsum": ["bsh,hf->bsf red=h"],
    "embedding": ["vh,bs->bsh red=v", "vh,->h red=v"],  # a vocab split gives masked partial rows
    "embedding_backward": ["bsh,bs->vh red=bs"],  # scatter-add sums over tokens
    "gather": ["ab,c->de need=abcde"],  # the general gather is not split
    # a KV-cache write: batch, heads and head dim split alike; which slots are written is data
    "index_copy": ["abcd,f,abed->abcd need=cef"],
    "iota": ["->ab"],
    "layer_norm": NORM_HAND,
    "layer_norm_backward": NORM_BACKWARD_HAND,
    "log_softmax": ROW_HAND,
    "log_softmax_backward": ["ab,ab->ab need=b"],
    "matmul": [
        "bsk,kn->bsn red=k",
        "k,kn->n red=k",
        "mk,k->m red=k",
        "a1mk,bkn->abmn red=k",  # lhs batch 1 broadcasts against the rhs batch b
    ],
    "nll_loss": LOSS_HAND,
    "nll_loss_backward": LOSS_BACKWARD_HAND,
    "pad": ["ab->cb need=a"],
    "reshape": [
        "(ab)c->a(bc)",  # 8x4 -> 2x16: 8 = 2*4, 16 = 4*4
        "(ab)->ab",
        "ab->cd need=ab",  # 2x3 -> 3x2: no common factor, nothing splits
        "ab->cd need=ab",
        "1a->a1",
        "->11",
    ],
    "rms_norm": ["ab,b->ab need=b", "ab,b->ab need=b"],
    "rms_norm_backward": NORM_BACKWARD_HAND,
    "scan_carry": ["ab->ab"],
    "scan_index": ["nab->ab need=n"],  # every iteration needs its whole slice
    "scan_loop": ["ab->ab"],
    "scan_stack": ["ab->nab need=n"],
    "slice": ["ab->cb need=a", "a->b need=a"],
    "softmax": ROW_HAND,
    "softmax_backward": ["ab,ab->ab need=b"],
    "sort": ROW_HAND,
    "topk": ["ab->ak,ak need=b"],
    "transpose": ["abc->cab", "->"],
}
for _kind in ("reduce_sum", "sum", "mean", "reduce_mean", "reduce_max", "reduce_min"):
    HAND[_kind] = REDUCE_HAND
for _kind in ("max_reduce", "amax", "amin"):
    HAND[_kind] = REDUCE_HAND[:1]


def _hand(kind: str) -> list[str]:
    return HAND.get(kind, ELEMENTWISE_HAND)


def canonical(spec: str, need: frozenset[str], red: frozenset[str], summed: tuple = ()) -> tuple:
    """The rule up to factor names: letters renamed in order of first appearance; ``summed`` is
    ``((factor, result indices), ...)``."""
    names: dict[str, str] = {}
    for ch in spec:
        if ch.isalpha() and ch not in names:
            names[ch] = chr(ord("a") + len(names))
    text = "".join(names.get(ch, ch) for ch in spec)
    sums = frozenset((names[f], tuple(sorted(i))) for f, i in summed)
    return text, frozenset(names[f] for f in need), frozenset(names[f] for f in red), sums


def _expected(line: str) -> tuple:
    """``spec [need=F..] [red=F..] [sum=F:RESULTS]`` (``sum=s:12``: s summed into results 1, 2)."""
    spec, *marks = line.split()
    flags = dict(m.split("=") for m in marks)
    summed = ()
    if "sum" in flags:
        factor, results = flags["sum"].split(":")
        summed = ((factor, tuple(int(r) for r in results)),)
    need, red = frozenset(flags.get("need", "")), frozenset(flags.get("red", ""))
    return canonical(spec, need, red, summed)


@pytest.mark.parametrize("kind", core_kinds())
def test_registry_rules_match_hand_written_factors(kind: str) -> None:
    """Every registered kind: each case's rule is the hand-derived one (up to factor names)."""
    hand = _hand(kind)
    assert len(hand) == len(cases(kind)), f"{kind}: one hand-written line per case"
    for (ins, outs, attrs), line in zip(cases(kind), hand, strict=True):
        rule = rule_for(kind, [tensor(t) for t in ins], [tensor(t) for t in outs], attrs)
        got = canonical(rule.spec, rule.need_replication, rule.reduction, rule.summed)
        assert got == _expected(line), f"{kind}({', '.join(ins)}): {rule} vs hand {line}"
        # sizes: each factor's size divides every dim it is part of, and dims multiply out
        size = rule.size_of
        for factors, t in zip(rule.operands + rule.results, ins + outs, strict=True):
            shape = tensor(t).shape
            assert tuple(math.prod(size[f] for f in dim) for dim in factors) == shape, t


def test_hand_written_table_covers_every_kind() -> None:
    assert set(HAND) <= set(core_kinds())
    assert set(core_kinds()) - set(HAND) == {
        k for k in core_kinds() if k not in SPECIAL
    }  # the rest are elementwise


@pytest.mark.parametrize("kind", core_kinds())
def test_registry_rules_fit_types_and_rebuild_from_spec(kind: str) -> None:
    """Each case's rule verifies against its op's types and rebuilds identically from its spec."""
    for ins, outs, attrs in cases(kind):
        graph = Graph("case")
        operands = [graph.add_input(f"x{i}", tensor(t)) for i, t in enumerate(ins)]
        op = graph.add_op(kind, operands, [tensor(t) for t in outs], attrs=attrs)
        verify(graph)
        rule = op.rule
        shapes = [tensor(t).shape for t in ins], [tensor(t).shape for t in outs]
        rebuilt = ShardingRule.from_spec(
            rule.spec, *shapes, rule.need_replication, rule.compound_only_sizes(), rule.summed
        )
        assert rebuilt == rule


@pytest.mark.parametrize(
    ("ins", "outs", "expected"),
    [
        (["f32[8,4]"], ["f32[2,16]"], "(ab)c->a(bc) {a=2, b=4, c=4}"),
        (["f32[2,16]"], ["f32[8,4]"], "a(bc)->(ab)c {a=2, b=4, c=4}"),
        (["f32[6]"], ["f32[2,3]"], "(ab)->ab {a=2, b=3}"),
        (["f32[2,3]"], ["f32[3,2]"], "ac->bd {a=2, c=3, b=3, d=2} need_replication={a, c}"),
        (["f32[4,1,6]"], ["f32[24]"], "a1b->(ab) {a=4, b=6}"),
    ],
)
def test_registry_reshape_gcd_factors(ins: list[str], outs: list[str], expected: str) -> None:
    rule = rule_for("reshape", [tensor(t) for t in ins], [tensor(t) for t in outs], {})
    assert str(rule) == expected


def test_registry_dot_rule_has_reduction_factor() -> None:
    rule = rule_for(
        "dot", [tensor("f32[16,64]"), tensor("f32[64,256]")], [tensor("f32[16,256]")], {}
    )
    assert str(rule) == "ik,kj->ij {i=16, k=64, j=256} reduction={k}"


def test_registry_layer_norm_square_weight_aligns_to_hidden_dim() -> None:
    ins = [tensor("f32[8,8]"), tensor("f32[8]")]
    rule = rule_for("layer_norm", ins, [tensor("f32[8,8]")], {"axis": 1})
    assert rule.spec == "ab,b->ab"


def test_registry_topk_smaller_k_fits_result_types() -> None:
    graph = Graph("topk")
    x = graph.add_input("x", tensor("f32[3,5]"))
    graph.add_op("topk", [x], [tensor("f32[3,2]"), tensor("i64[3,2]")], attrs={"axis": 1})
    verify(graph)


def test_registry_unknown_kind_warns_and_replicates() -> None:
    ins, outs = [tensor("f32[3,5]"), tensor("f32[5]")], [tensor("f32[3]")]
    origin = Origin(module="model.block", source="model.py:12")
    with pytest.warns(UnsupportedOpWarning, match=r"'frobnicate' at model\.block \(model\.py:12\)"):
        rule = rule_for("frobnicate", ins, outs, {}, origin)
    assert rule.need_replication == frozenset(rule.factor_names)
    assert str(rule) == "ab,c->d {a=3, b=5, c=5, d=3} need_replication={a, b, c, d}"
    assert rule.reduction == frozenset()


def test_registry_unknown_kind_through_add_op_warns() -> None:
    graph = Graph("g")
    x = graph.add_input("x", tensor("f32[4]"))
    with pytest.warns(UnsupportedOpWarning, match="my_custom_op"):
        op = graph.add_op("my_custom_op", [x], [tensor("f32[4]")], origin=Origin(module="m"))
    assert op.rule.need_replication == {"a", "b"}
