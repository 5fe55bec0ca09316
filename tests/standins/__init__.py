"""Stand-ins for the libraries the GPU path runs on (DeepSpeed ZeRO-3, NCCL, vLLM, SGLang), for
tests on a machine without a GPU. Each one copies the behaviour of the upstream code it names
(file and version), refusals included, so that a test passes only where the real library would
let the project's code through. What a stand-in cannot model on a CPU is said in its docstring."""
