"""CUDA graphs of a fixed plan's cells.

cell_graphs: one CUDA graph per compute action, captured once and replayed every iteration;
graph_audit: the capture-safety audit (what would break a capture or a replay, seen on CPU);
cpu_graph: a CPU stand-in for a CUDA graph that replays like one.

May import: runtime.context, runtime.graphs
"""
