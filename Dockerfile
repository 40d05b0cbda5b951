# megalite on an official PyTorch CUDA image (torch >= 2.9, for torchrun's --signals-to-handle).
#   docker build -t megalite .
#   docker run --gpus all --ipc=host --rm -v $PWD/runs:/workspace/megalite/runs megalite \
#       torchrun --nproc_per_node gpu -m megalite.train --config configs/gpt2-small.yaml
ARG BASE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE}

WORKDIR /workspace/megalite
ENV PYTHONUNBUFFERED=1
# The image's torch satisfies megalite's requirement, so pip keeps it and installs the rest.
COPY pyproject.toml README.md ./
COPY megalite ./megalite
COPY configs ./configs
COPY bench ./bench
RUN pip install --no-cache-dir -e ".[wandb]" \
 && pip install --no-cache-dir --no-build-isolation "deepspeed>=0.19.8"

CMD ["torchrun", "--nproc_per_node", "gpu", "-m", "megalite.train", "--config", "configs/demo.yaml"]
