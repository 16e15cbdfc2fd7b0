"""Framework-free transformer training steps (GPT / Llama shapes) built with GraphBuilder.

For tests and benchmarks that need a realistic training step without torch or jax: forward,
loss, a hand-written backward and a fused AdamW update, in mixed precision (fp32 master
weights and moments as inputs, bf16 compute copies made by ``convert`` in each layer's forward,
bf16 gradients). Names follow the HF checkpoints (``layers.3.mlp.gate_proj.weight`` for Llama,
``h.3.mlp.c_fc.weight`` for GPT), so ``sp.strategies`` patterns and layer detection
(``layers.<i>`` / ``h.<i>``) apply unchanged::

    graph = training_step(LLAMA3_8B, batch=8, layers=2)   # 2 of 32 layers, full per-layer shapes

Simplifications (documented in docs/memory.md): no linear biases, attention is one fused op
(flash attention: no s x s tensor is stored), GQA repeats K/V heads with a broadcast, and the
update is one elementwise ``adamw`` op per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import Graph, Origin, Role, Value
from .builder import GraphBuilder
from .shape_rules import elementwise
from .types import TensorType


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    """Shape of a decoder-only transformer; ``arch`` picks GPT (LayerNorm, GELU) or Llama."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    arch: str = "llama"
    kv_heads: int = 0
    """0 means ``heads`` (no grouped-query attention)."""

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    def layer_params(self) -> int:
        h, d = self.hidden, self.hidden // self.heads
        attention = 2 * h * h + 2 * h * self.kv * d
        mlp = (3 if self.arch == "llama" else 2) * h * self.ffn
        return attention + mlp + 2 * h

    @property
    def params(self) -> int:
        """Parameter count (untied embedding and head)."""
        extra = self.seq * self.hidden if self.arch == "gpt" else 0
        return self.layers * self.layer_params() + 2 * self.vocab * self.hidden + extra


GPT_125M = TransformerConfig("gpt-125m", 12, 768, 12, 3072, 50304, 2048, "gpt")
GPT_1_3B = TransformerConfig("gpt-1.3b", 24, 2048, 16, 8192, 50304, 2048, "gpt")
GPT_6_7B = TransformerConfig("gpt-6.7b", 32, 4096, 32, 16384, 50304, 2048, "gpt")
LLAMA2_7B = TransformerConfig("llama2-7b", 32, 4096, 32, 11008, 32000, 4096)
LLAMA3_8B = TransformerConfig("llama3-8b", 32, 4096, 32, 14336, 128256, 8192, kv_heads=8)
LLAMA2_13B = TransformerConfig("llama2-13b", 40, 5120, 40, 13824, 32000, 4096)
LLAMA3_70B = TransformerConfig("llama3-70b", 80, 8192, 64, 28672, 128256, 8192, kv_heads=8)
CONFIGS = {
    c.name: c for c in (GPT_125M, GPT_1_3B, GPT_6_7B, LLAMA2_7B, LLAMA3_8B, LLAMA2_13B, LLAMA3_70B)
}


def training_step(
    config: TransformerConfig, batch: int, layers: int | None = None, seq: int | None = None
) -> Graph:
    """One mixed-precision AdamW training step of ``config`` on ``batch`` sequences.

    Args:
      layers: build only this many layers (same per-layer shapes), for fast planning.
      seq: override the sequence length.
    """
    config = replace(config, layers=layers or config.layers, seq=seq or config.seq)
    return _Step(config, batch).build()


class _Step:
    """Builds forward, backward and update; ``self.params`` remembers (master, grad) pairs."""

    def __init__(self, config: TransformerConfig, batch: int) -> None:
        self.c, self.batch = config, batch
        self.b = GraphBuilder(f"{config.name}_train_step")
        self.params: list[tuple[Value, Value | None]] = []
        self.stack = "h" if config.arch == "gpt" else "layers"

    # -- helpers -------------------------------------------------------------------------------
    def weight(self, path: str, shape: tuple[int, ...]) -> tuple[Value, Value]:
        """fp32 master (a parameter) and its bf16 compute copy (a convert in this scope)."""
        master = self.b.param(f"{path}.weight", shape, "f32")
        self.params.append((master, None))
        return master, self.b.convert(master, "bf16")

    def grad(self, master: Value, g: Value) -> None:
        index = next(i for i, (m, _) in enumerate(self.params) if m is master)
        self.params[index] = (master, g)

    def ein(self, equation: str, a: Value, w: Value) -> Value:
        ins, out = equation.split("->")
        sizes = dict(zip(ins.split(",")[0], a.type.shape, strict=True))
        sizes.update(zip(ins.split(",")[1], w.type.shape, strict=True))
        shape = tuple(sizes[f] for f in out)
        return self.b.op("einsum", [a, w], [TensorType(shape, "bf16")], equation=equation)

    def norm(self, x: Value, w: Value) -> Value:
        return self.b.layer_norm(x, w) if self.c.arch == "gpt" else self.b.rms_norm(x, w)

    def norm_backward(self, d: Value, x: Value, w: Value, master: Value) -> Value:
        kind = "layer_norm_backward" if self.c.arch == "gpt" else "rms_norm_backward"
        dx = self.b.op(kind, [d, x, w], [x.type], axis=2)
        self.grad(master, self.b.reduce_sum(self.b.mul(d, x), axes=(0, 1)))
        return dx

    # -- the step ------------------------------------------------------------------------------
    def build(self) -> Graph:
        c, b = self.c, self.b
        ids = b.input("batch.input_ids", (self.batch, c.seq), "i32")
        labels = b.input("batch.labels", (self.batch, c.seq), "i32")
        with b.scope("embed_tokens"):
            table, table16 = self.weight("embed_tokens", (c.vocab, c.hidden))
            x = b.embedding(table16, ids)
        saved = []
        for i in range(c.layers):
            with b.scope(f"{self.stack}.{i}"):
                x, layer = self.layer_forward(i, x)
            saved.append(layer)
        with b.scope("lm_head"):
            nw, nw16 = self.weight("norm", (c.hidden,))
            head, head16 = self.weight("lm_head", (c.hidden, c.vocab))
            xf = self.norm(x, nw16)
            logits = self.ein("bsh,hv->bsv", xf, head16)
            loss = b.cross_entropy(logits, labels)
            d_logits = b.op("cross_entropy_backward", [logits, labels], [logits.type], axis=2)
            self.grad(head, self.ein("bsh,bsv->hv", xf, d_logits))
            d = self.norm_backward(self.ein("bsv,hv->bsh", d_logits, head16), x, nw16, nw)
        for i in reversed(range(c.layers)):
            with b.scope(f"{self.stack}.{i}"):
                d = self.layer_backward(d, saved[i])
        with b.scope("embed_tokens"):
            g_table = b.op("embedding_backward", [d, ids], [TensorType(table.type.shape, "bf16")])
            self.grad(table, g_table)
        return self.update(loss)

    def layer_forward(self, i: int, x: Value) -> tuple[Value, dict]:
        c, b = self.c, self.b
        p = f"{self.stack}.{i}"
        s: dict = {"x": x}
        gpt = c.arch == "gpt"
        s["n1w"] = self.weight(f"{p}.{'ln_1' if gpt else 'input_layernorm'}", (c.hidden,))
        s["n1"] = n1 = self.norm(x, s["n1w"][1])
        head_dim = c.hidden // c.heads
        names = ("q_proj", "k_proj", "v_proj")
        widths = (c.hidden, c.kv * head_dim, c.kv * head_dim)
        for key, name, width in zip("qkv", names, widths, strict=True):
            attn = "attn" if gpt else "self_attn"
            s[f"w{key}"] = self.weight(f"{p}.{attn}.{name}", (c.hidden, width))
            proj = self.ein("bsh,hd->bsd", n1, s[f"w{key}"][1])
            s[key] = self.heads(proj, width // head_dim)
        s["o"] = o = b.attention(s["q"], s["k"], s["v"], causal=True)
        flat = b.reshape(b.transpose(o, (0, 2, 1, 3)), (self.batch, c.seq, c.hidden))
        s["attn_flat"] = flat
        s["wo"] = self.weight(
            f"{p}.{'attn.c_proj' if gpt else 'self_attn.o_proj'}", (c.hidden,) * 2
        )
        s["x2"] = x2 = b.add(x, self.ein("bsd,dh->bsh", flat, s["wo"][1]))
        s["n2w"] = self.weight(f"{p}.{'ln_2' if gpt else 'post_attention_layernorm'}", (c.hidden,))
        s["n2"] = n2 = self.norm(x2, s["n2w"][1])
        if gpt:
            s["wup"] = self.weight(f"{p}.mlp.c_fc", (c.hidden, c.ffn))
            s["up"] = up = self.ein("bsh,hf->bsf", n2, s["wup"][1])
            s["act"] = act = b.gelu(up)
            s["wdown"] = self.weight(f"{p}.mlp.c_proj", (c.ffn, c.hidden))
        else:
            s["wgate"] = self.weight(f"{p}.mlp.gate_proj", (c.hidden, c.ffn))
            s["wup"] = self.weight(f"{p}.mlp.up_proj", (c.hidden, c.ffn))
            s["gate"] = gate = self.ein("bsh,hf->bsf", n2, s["wgate"][1])
            s["up"] = up = self.ein("bsh,hf->bsf", n2, s["wup"][1])
            s["silu"] = silu = b.op("silu", [gate], [gate.type])
            s["act"] = act = b.mul(silu, up)
            s["wdown"] = self.weight(f"{p}.mlp.down_proj", (c.ffn, c.hidden))
        return b.add(x2, self.ein("bsf,fh->bsh", act, s["wdown"][1])), s

    def heads(self, proj: Value, heads: int) -> Value:
        """[b,s,heads*d] -> [b,H,s,d], repeating K/V heads for grouped-query attention."""
        b, c = self.b, self.c
        d = c.hidden // c.heads
        x = b.transpose(b.reshape(proj, (self.batch, c.seq, heads, d)), (0, 2, 1, 3))
        if heads == c.heads:
            return x
        group = c.heads // heads
        shape = (self.batch, heads, group, c.seq, d)
        wide = b.op("broadcast_in_dim", [x], [TensorType(shape, "bf16")], dims=(0, 1, 3, 4))
        return b.reshape(wide, (self.batch, c.heads, c.seq, d))

    def layer_backward(self, d: Value, s: dict) -> Value:
        """Gradients of one layer, in reverse; weight gradients are recorded for the update."""
        c, b = self.c, self.b
        gpt = c.arch == "gpt"
        wdown_m, wdown = s["wdown"]
        self.grad(wdown_m, self.ein("bsf,bsh->fh", s["act"], d))
        d_act = self.ein("bsh,fh->bsf", d, wdown)
        if gpt:
            d_up = b.op("gelu_backward", [d_act, s["up"]], [d_act.type])
            d_n2 = self.ein("bsf,hf->bsh", d_up, s["wup"][1])
            self.grad(s["wup"][0], self.ein("bsh,bsf->hf", s["n2"], d_up))
        else:
            d_up = b.mul(d_act, s["silu"])
            d_gate = b.op("silu_backward", [b.mul(d_act, s["up"]), s["gate"]], [d_act.type])
            self.grad(s["wup"][0], self.ein("bsh,bsf->hf", s["n2"], d_up))
            self.grad(s["wgate"][0], self.ein("bsh,bsf->hf", s["n2"], d_gate))
            d_n2 = b.add(
                self.ein("bsf,hf->bsh", d_up, s["wup"][1]),
                self.ein("bsf,hf->bsh", d_gate, s["wgate"][1]),
            )
        d2 = b.add(d, self.norm_backward(d_n2, s["x2"], s["n2w"][1], s["n2w"][0]))
        self.grad(s["wo"][0], self.ein("bsd,bsh->dh", s["attn_flat"], d2))
        d_flat = self.ein("bsh,dh->bsd", d2, s["wo"][1])
        heads = (self.batch, c.seq, c.heads, c.hidden // c.heads)
        d_o = b.transpose(b.reshape(d_flat, heads), (0, 2, 1, 3))
        types = [s["q"].type, s["k"].type, s["v"].type]
        operands = [d_o, s["q"], s["k"], s["v"], s["o"]]
        grads = b.op_results("attention_backward", operands, types, causal=True)
        d_n1 = None
        for key, g in zip("qkv", grads, strict=True):
            proj = self.unheads(g, s[f"w{key}"][1].type.shape[1])
            self.grad(s[f"w{key}"][0], self.ein("bsh,bsd->hd", s["n1"], proj))
            part = self.ein("bsd,hd->bsh", proj, s[f"w{key}"][1])
            d_n1 = part if d_n1 is None else b.add(d_n1, part)
        assert d_n1 is not None
        return b.add(d2, self.norm_backward(d_n1, s["x"], s["n1w"][1], s["n1w"][0]))

    def unheads(self, g: Value, width: int) -> Value:
        """[b,H,s,d] -> [b,s,width], summing repeated K/V heads back into their group."""
        b, c = self.b, self.c
        d = c.hidden // c.heads
        heads = width // d
        if heads != c.heads:
            grouped = b.reshape(g, (self.batch, heads, c.heads // heads, c.seq, d))
            g = b.reduce_sum(grouped, axes=2)
        return b.reshape(b.transpose(g, (0, 2, 1, 3)), (self.batch, c.seq, width))

    def update(self, loss: Value) -> Graph:
        """Fused AdamW per parameter: (w, g, m, v) -> (w', m', v'), aliased back to the inputs."""
        b = self.b
        outputs, aliases = [loss], {}
        for master, g in self.params:
            assert g is not None, f"no gradient for {master.name}"
            path = master.origin.path
            m = b.input(f"{path}#exp_avg", master.type.shape, "f32", role=Role.OPTIMIZER_STATE)
            v = b.input(f"{path}#exp_avg_sq", master.type.shape, "f32", role=Role.OPTIMIZER_STATE)
            results = adamw(b, master, g, m, v)
            for new, old in zip(results, (master, m, v), strict=True):
                aliases[len(outputs)] = self.b.graph.inputs.index(old)
                outputs.append(new)
        b.output(*outputs, aliases=aliases)
        return b.build()


def adamw(b: GraphBuilder, w: Value, g: Value, m: Value, v: Value) -> tuple[Value, ...]:
    """Fused AdamW ``(w, g, m, v) -> (w', m', v')``: elementwise on the parameter's shape.

    The rule is given explicitly (the kind is not in the registry): every factor passes through.
    """
    ins, outs = [x.type for x in (w, g, m, v)], [w.type, m.type, v.type]
    rule = elementwise(ins, outs, {})
    op = b.graph.add_op("adamw", [w, g, m, v], outs, rule=rule, origin=Origin(module=b.module))
    return tuple(op.results)
