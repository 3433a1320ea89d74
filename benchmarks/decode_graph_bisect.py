"""Which part of the one-row decode graph makes it slower than another tree's: the graph recaptured with that
tree's decode-attention and prepare-qkv kernels put in place of this tree's, each replayed 1,000 times back
to back (microseconds a step, CUDA's clock by the host's), and the graph's structure written as a DOT file
(kernel names, grids, shared memory, edges) to compare with the other tree's.

    python benchmarks/decode_graph_bisect.py --random-checkpoint /tmp/q06 --other .device/before --out DIR
    python benchmarks/decode_graph_bisect.py --random-checkpoint /tmp/q06 --tree .device/before --out DIR

(Run as a script, not with -m, so that --tree's `nanovllm` comes first on the path.)
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-checkpoint", required=True, metavar="DIR")
    parser.add_argument("--tree", default=ROOT, help="the tree whose engine runs (its nanovllm/ first on the path)")
    parser.add_argument("--other", help="the tree whose kernels are put in, one part at a time")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--free-others", action="store_true", help="then free every other graph and capture again")
    parser.add_argument("--kernels", action="store_true",
                        help="the engine's graph and a recapture, kernel by kernel, under torch.profiler")
    return parser.parse_args()


def load_module(tree: str, relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(tree, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    args = parse_args()
    sys.path[:0] = [os.path.abspath(args.tree), ROOT]
    import torch

    import nanovllm
    import nanovllm.layers.attention_flash as attention_flash
    from benchmarks.graph_replay import kernel_times, queued, recapture_decode
    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.checkpoint import random_qwen3_0_6b_checkpoint
    os.makedirs(args.out, exist_ok=True)
    llm = LLM(random_qwen3_0_6b_checkpoint(args.random_checkpoint))
    llm.generate([[7] * 128], SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64), use_tqdm=False)
    runner = llm.executor.model_runner
    graphs = runner.decode_graphs

    def captured(dump: str | None = None, own_pool: bool = False):
        graph = recapture_decode(runner, own_pool=own_pool, debug=dump is not None)
        if dump:
            graph.debug_dump(os.path.join(args.out, dump))
        return graph

    def us_per_step(graph) -> float:
        return round(statistics.median(queued([graph.replay] * args.steps) for _ in range(3)) * 1e6, 1)

    tree = os.path.basename(os.path.dirname(os.path.dirname(nanovllm.__file__))) or "tree"
    report = {"tree": nanovllm.__file__, "engine's graph": us_per_step(graphs.decode_graphs[1]),
              "recaptured": us_per_step(captured(f"decode_graph_{tree}.dot")),
              "recaptured in a pool of its own": us_per_step(captured(own_pool=True))}
    if args.other:
        ours = attention_flash.decode_attention, attention_flash.prepare_qkv
        theirs_attention = load_module(args.other, "nanovllm/layers/decode_attention.py", "other_decode_attention")
        theirs_qkv = load_module(args.other, "nanovllm/layers/prepare_qkv.py", "other_prepare_qkv")

        def their_prepare_qkv(qkv, positions, heads, norms, cos_sin_cache, k_cache, v_cache, slot_mapping, keep_kv):
            return theirs_qkv.prepare_qkv(qkv, positions, heads, *norms, cos_sin_cache, k_cache, v_cache,
                                          slot_mapping, keep_kv)
        swaps = {"their decode_attention": (theirs_attention.decode_attention, ours[1]),
                 "their prepare_qkv": (ours[0], their_prepare_qkv),
                 "both theirs": (theirs_attention.decode_attention, their_prepare_qkv)}
        for name, (attention, prepare) in swaps.items():
            attention_flash.decode_attention, attention_flash.prepare_qkv = attention, prepare
            report[name] = us_per_step(captured())
        attention_flash.decode_attention, attention_flash.prepare_qkv = ours
    if args.free_others:  # does a graph's speed depend on how many others exist when it is captured?
        kept = graphs.decode_graphs[1]
        graphs.decode_graphs, graphs.sample_graphs = {1: kept}, {}
        getattr(graphs, "logprobs_graphs", {}).clear()
        torch.cuda.synchronize()
        report["recaptured with the engine's other graphs freed"] = us_per_step(captured())
        report["the engine's graph, the others freed"] = us_per_step(kept)
    if args.kernels:  # where the engine's graph and a recapture of the same code differ, kernel by kernel
        engine, again = kernel_times(graphs.decode_graphs[1]), kernel_times(captured())
        report["kernels, us a replay: engine's graph / recaptured"] = {
            name: [engine.get(name, (0,))[0], again.get(name, (0,))[0]] for name in sorted({*engine, *again})}
    print(json.dumps(report), flush=True)
    llm.exit()


if __name__ == "__main__":
    main()
