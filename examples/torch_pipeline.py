"""Pipeline stages for a tiny Hugging Face Llama: plan, print the split, run one step on gloo.

Run: ``python examples/torch_pipeline.py``. The planner picks the stage boundaries and the number
of micro-batches; the emitter turns them into ``torch.distributed.pipelining`` split points, a
schedule class and this rank's ``PipelineStage``. The step runs on 2 gloo processes (one stage
each) and its loss is compared with the unpipelined model's.
"""

from __future__ import annotations

import sys
from pathlib import Path

FACTORY = str(Path(__file__).resolve().parent / "hf_llama.py") + ":make"
SHAPES = {"batch": 4, "seq": 8, "hidden": 32, "layers": 4, "heads": 4, "kv_heads": 2, "vocab": 64}


def main() -> None:
    import shardplan as sp
    from shardplan.frontend.torch.gloo import load_factory, run_pipeline_on_gloo
    from shardplan.frontend.torch.pipeline import pipeline_schedule, pipeline_spec

    model, inputs = load_factory(FACTORY)(**SHAPES)
    # Stages on "pp", tensor parallelism inside each stage on "tp" (run_pipeline_on_gloo runs
    # such a plan on pp x tp processes, see docs/torch.md; below, a pp-only plan on 2).
    plan = sp.plan(
        model, *inputs, mesh=sp.Mesh({"pp": 2, "tp": 2}, cluster="cpu-test"), microbatches=2
    )
    print(plan)
    pipe = plan.pipeline
    step_us = pipe.step_time * 1e6
    print(f"pipeline over {pipe.axis!r}: {pipe.schedule}, {pipe.microbatches} micro-batches, "
          f"bubble {pipe.bubble_fraction:.0%}, step {step_us:.0f} us modelled")  # fmt: skip
    for stage in pipe.stages:
        print(f"  stage {stage.index}: {stage.stack}[{stage.layers[0]}..{stage.layers[-1]}]"
              f"{' + embedding' if stage.first_stage_extras else ''}, "
              f"{stage.memory_bytes / 2**10:.0f} KiB per device")  # fmt: skip
    print("split spec:", plan.pipeline_split_spec())
    schedule, microbatches = pipeline_schedule(plan)
    print(f"schedule: {schedule.__name__} with {microbatches} micro-batches")

    pp_only = sp.plan(model, *inputs, mesh=sp.Mesh({"pp": 2}, cluster="cpu-test"), microbatches=2)
    spec = pipeline_spec(pp_only)
    print("running", spec)
    result = run_pipeline_on_gloo(spec, FACTORY, **SHAPES)
    reference = float(model(**inputs[0]).loss.detach())
    loss = float(result["loss"])
    if abs(loss - reference) > 1e-4 * abs(reference):
        print(f"CHECK FAILED: pipelined loss {loss} != unpipelined {reference}", file=sys.stderr)
        raise SystemExit(1)
    print(
        f"check passed: the pipelined step on 2 gloo ranks gives loss {loss:.6f}, the "
        f"unpipelined model's (rtol 1e-4)"
    )


if __name__ == "__main__":
    main()
