"""A hand-built training step of a 2-layer MLP: the CLI's default example.

``shardplan plan examples/mlp_graph.py:make --mesh dp=2,tp=4 --cluster h100-sxm`` plans it.
The step is forward (dot -> relu -> dot), a squared-error loss, backward, and an SGD update
whose new weights alias the old ones, so data-parallel gradient reduction, Megatron column/row
splits and parameter sharding all compete on the same graph.
"""

from __future__ import annotations

from shardplan.ir import Graph, Origin, Role, TensorType


def make(batch: int = 2048, model: int = 4096, hidden: int = 16384, dtype: str = "bf16") -> Graph:
    """The step for ``x[batch, model] -> relu(x @ w1) @ w2``, trained against ``y``.

    Args:
      batch: tokens per step (the data-parallel dimension).
      model: input and output width.
      hidden: inner width (the tensor-parallel dimension).
      dtype: element type of every tensor.
    Returns:
      the IR graph; outputs are the loss and the updated ``w1``, ``w2`` (aliasing the inputs).
    """
    g = Graph(name="mlp_train_step")
    t = lambda *shape: TensorType(shape, dtype)  # noqa: E731 - a local shorthand reads better
    x = g.add_input("x", t(batch, model), Role.INPUT, Origin(path="batch['x']"))
    y = g.add_input("y", t(batch, model), Role.INPUT, Origin(path="batch['y']"))
    w1 = g.add_input("w1", t(model, hidden), Role.PARAMETER, Origin(path="mlp.fc1.weight"))
    w2 = g.add_input("w2", t(hidden, model), Role.PARAMETER, Origin(path="mlp.fc2.weight"))

    def op(kind: str, *operands, shape, name: str, module: str, **attrs):
        origin = Origin(module=module)
        return g.add_op(kind, operands, [t(*shape)], attrs=attrs, origin=origin, names=[name])

    fwd, bwd, opt = "mlp.forward", "mlp.backward", "sgd"

    # forward
    h = op("dot", x, w1, shape=(batch, hidden), name="h", module=fwd).result
    a = op("relu", h, shape=(batch, hidden), name="a", module=fwd).result
    out = op("dot", a, w2, shape=(batch, model), name="out", module=fwd).result
    diff = op("sub", out, y, shape=(batch, model), name="diff", module=fwd).result
    sq = op("mul", diff, diff, shape=(batch, model), name="sq", module=fwd).result
    loss = op("reduce_sum", sq, shape=(), name="loss", module=fwd, axes=(0, 1)).result

    # backward (d loss / d out = 2 * diff, written as diff + diff)
    g_out = op("add", diff, diff, shape=(batch, model), name="g_out", module=bwd).result
    g_w2 = op(
        "einsum", a, g_out, shape=(hidden, model), name="g_w2", module=bwd, equation="bh,bd->hd"
    ).result
    g_a = op(
        "einsum", g_out, w2, shape=(batch, hidden), name="g_a", module=bwd, equation="bd,hd->bh"
    ).result
    g_h = op("relu_backward", g_a, h, shape=(batch, hidden), name="g_h", module=bwd).result
    g_w1 = op(
        "einsum", x, g_h, shape=(model, hidden), name="g_w1", module=bwd, equation="bm,bh->mh"
    ).result

    # SGD with the learning rate folded into the gradient: w <- w - g
    w1_new = op("sub", w1, g_w1, shape=(model, hidden), name="w1_new", module=opt).result
    w2_new = op("sub", w2, g_w2, shape=(hidden, model), name="w2_new", module=opt).result
    g.set_outputs([loss, w1_new, w2_new], aliases={1: 2, 2: 3})
    return g
