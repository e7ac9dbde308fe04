"""The fused mixture-of-experts op `kiln::fused_moe` (op.py): the routed experts of one MoE layer as two grouped
GEMM Triton kernels (kernels.py) over tokens sorted by expert (align.py), with launch configurations from a table
tuned on the H200 (configs.py) and a torch reference (reference.py) that is the CPU path and the tests' oracle;
and the routing op `kiln::moe_route` (routing.py, routing_triton.py). docs/moe.md says why it is shaped so."""
