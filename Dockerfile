# The nanotrn image for Amazon EKS (docs/eks.md; scripts/eks.py runs it): the Neuron
# PyTorch training container of the release that scripts/env.sh pins (NANOTRN_NEURON_SDK,
# NANOTRN_TORCH_NEURONX), with nanotrn and its requirements. torch, torch-xla, torch-neuronx and
# neuronx-cc come from the base image and stay as they are: requirements.txt names none of them
# (requirements-torch.txt is for CPU machines; never install it here).
#
#   docker build -t nanotrn .
#
# The base is the Neuron Deep Learning Container for training (Neuron docs, "Neuron Deep Learning
# Containers": pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.29.0-ubuntu24.04, also in ECR as
# 763104351884.dkr.ecr.<region>.amazonaws.com/pytorch-training-neuronx); AWS's own Trainium EKS
# example builds on the same image (aws-samples/awsome-distributed-training,
# 3.test_cases/pytorch/neuronx-distributed/llama3/kubernetes/Dockerfile). It ships the Neuron
# runtime, the EFA libfabric, torchrun and neuron_parallel_compile.
FROM public.ecr.aws/neuron/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.29.0-ubuntu24.04

WORKDIR /opt/nanotrn
COPY requirements.txt ./
RUN python3 -m pip install --no-cache-dir -r requirements.txt
COPY . .
# The image is the release env.sh pins, or the build stops here naming both versions.
RUN pin="$(sed -n 's/^NANOTRN_TORCH_NEURONX=//p' scripts/env.sh)" && \
    python3 -c 'import importlib.metadata as m, sys; v = m.version("torch-neuronx"); \
sys.exit(0 if v.startswith(sys.argv[1]) else f"torch-neuronx {v} is not {sys.argv[1]}, the pin of scripts/env.sh")' "$pin" && \
    bash -n scripts/launch.sh
# And it has every command the pods run outside bash: torchrun, neuron_parallel_compile (launch.sh compile) and
# procps's pkill and pgrep (launch.sh's stop path: without them a SIGTERM never reaches the workers and the
# final save is lost). One name at a time: `command -v a b` in /bin/sh (dash) answers for a alone.
RUN for c in torchrun neuron_parallel_compile pkill pgrep; do \
        command -v "$c" >/dev/null || { echo "error: the image has no $c (see the Dockerfile)"; exit 1; }; done
