"""What the tests share, each module named for what it holds (no test module imports another;
fixtures that several test modules use are tests/conftest.py's, built from these).

harness: a function run on N gloo processes (run_distributed), and its torchrun entry point.
nodes: a free port, and torchrun agents on this machine standing for nodes (Nodes).
launch: torchrun's command line, a command run from the repository root, every process of a
  run killed, what a launch said, the arguments each command requires.
runs: the trainer's test runs (common settings, run_train, train_run, losses,
  assert_same_training), the memoised single-process run a layout is compared with
  (one_process_runs), the Llama and DeepSeek-V3 settings.
resume: runs that stop and resume, and the checks that a resumed run continues the original.
checkpoints: a save without a training run, a checkpoint's tensors read whole, a full disk.
models: small model configs, padded batches, whole tensors gathered from their shards.
reference_model: the transformer written out by hand.
layers, attention, generation, moe, bf16, gpu: what the model tests of each part check with.
data: documents and tokenizers written for data preparation, jsonl files.
chat: chat templates and conversations. tokenizer_shapes: GPT-2-, Llama 2- and Llama 3-shaped
  Hugging Face tokenizers. hf: transformers' side of the interop tests.
slurm_cluster: a one-node Slurm for the sweep tests.
"""
