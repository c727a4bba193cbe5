"""Which contenders launch with programmatic dependent launch (PDL)? Read it off their graphs.

    python benchmarks/pdl_probe.py --shape 16384x128x4096 --config '{"TILE_M": 128, ...}'

Captures two back-to-back launches of each contender (cuBLAS, cuBLASLt's heuristic pick,
torch.matmul when installed, and one cute_sm90 config with and without PDL) into a CUDA
graph, exactly as the benchmark's offline mode does, then lists every kernel node and the
type of every edge through the driver API. A launch made with PDL is captured as a
*programmatic* edge (CUDA >= 12.3): the second kernel may start while the first drains.
Nothing is timed: this says whether a vendor library overlaps its own back-to-back launches
in our offline timing (NOTES.md, session 6).
"""

from __future__ import annotations

import argparse
import ctypes

from ncu_probe import build_config  # this script's folder: the same config build

from tuner.gpu_worker import Buffers, Cublas, CublasLt, _cp, capture_launches, load_candidate
from tuner.search import launch_spec

EDGE_TYPES = {0: "default", 1: "programmatic"}  # CUgraphDependencyType
PORTS = {0: "end", 1: "programmatic", 2: "launch-order"}  # CU_GRAPH_KERNEL_NODE_PORT_*


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _kernel_name(cu, node) -> str:
    params = (ctypes.c_void_p * 16)()  # CUDA_KERNEL_NODE_PARAMS_v2: func first, kern at slot 7
    if cu.cuGraphKernelNodeGetParams_v2(node, params) != 0:
        return "?"
    name = ctypes.c_char_p()
    if params[0] and cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params[0])) == 0 and name.value:
        return name.value.decode()
    if params[7] and cu.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params[7])) == 0 and name.value:
        return name.value.decode()
    return "?"


def describe(graph_handle: int) -> tuple[list[str], list[str]]:
    """(kernel names in node order, 'from_port/type' of every edge) of a cudaGraph_t."""
    cu = _driver()
    g = ctypes.c_void_p(graph_handle)
    n = ctypes.c_size_t(0)
    cu.cuGraphGetNodes(g, None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * n.value)()
    cu.cuGraphGetNodes(g, nodes, ctypes.byref(n))
    kernels = []
    for node in nodes:
        kind = ctypes.c_int(-1)
        cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        kernels.append(_kernel_name(cu, ctypes.c_void_p(node)) if kind.value == 0 else f"(node type {kind.value})")
    get_edges = getattr(cu, "cuGraphGetEdges_v2", None) or cu.cuGraphGetEdges
    e = ctypes.c_size_t(0)
    get_edges(g, None, None, None, ctypes.byref(e))
    src, dst, data = (ctypes.c_void_p * e.value)(), (ctypes.c_void_p * e.value)(), (EdgeData * e.value)()
    get_edges(g, src, dst, data, ctypes.byref(e))
    edges = [f"{PORTS.get(d.from_port, d.from_port)}/{EDGE_TYPES.get(d.type, d.type)}" for d in data]
    return kernels, edges


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True)
    ap.add_argument("--config", required=True, help="a cute_sm90 config as JSON (compile and run-time knobs)")
    args = ap.parse_args()
    cp = _cp()
    fam, full, shape, target, built = build_config(args.shape, args.config)
    sm_count = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    buf = Buffers(shape.M, shape.N, shape.K)
    stream = cp.cuda.Stream(non_blocking=True)
    variant = fam.runtime_config(full)
    spec = launch_spec(fam, full, shape, target) | {"sm_count": sm_count}
    contenders = {"cublas": Cublas(stream)}
    lt = CublasLt(stream, buf)
    contenders["cublaslt"] = lt.heuristic()
    for pdl in (False, True):
        kernel = load_candidate(built.cubin, spec | {"pdl": pdl})
        kernel.reserve(shape.M, shape.N, shape.K, [variant])
        contenders[f"cute_sm90{'+PDL' if pdl else ''}"] = kernel.launcher(variant)
    try:
        import torch

        ext = torch.cuda.ExternalStream(stream.ptr)
        a, b, c = (torch.from_dlpack(x) for x in (buf.A, buf.B, buf.C))

        def torch_mm(_buf, _stream):
            with torch.cuda.stream(ext):
                torch.matmul(a, b.t(), out=c)
        torch_mm(buf, stream)  # cuBLAS handle and workspace set up outside the capture
        contenders["torch.matmul"] = torch_mm
    except ImportError:
        pass
    print(f"{shape}: two back-to-back launches per graph, as in offline timing")
    print("| contender | kernels | edges (port/type) | PDL between launches |")
    print("|---|---|---|---|")
    for name, launch in contenders.items():
        with stream:
            launch(buf, stream)  # warm: lazy set-up (workspaces, handles) stays out of the graph
            stream.synchronize()
            graph = capture_launches(launch, buf, stream, 2)
        kernels, edges = describe(graph.graph)
        short = ", ".join(k[:90] for k in kernels)
        print(f"| {name} | {short} | {', '.join(edges) or '-'} | "
              f"{'yes' if any('programmatic' in e for e in edges) else 'no'} |")


if __name__ == "__main__":
    main()
