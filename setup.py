"""alpa: automatic inter- and intra-operator parallelism for JAX, on stock JAX."""

from setuptools import find_packages, setup

setup(
    name="alpa",
    version="0.1.0",
    description="Automatic parallelization of JAX training steps (pipeline and sharding).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["alpa", "alpa.*"]),
    install_requires=[
        "jax>=0.10,<0.11",
        "jaxlib>=0.10,<0.11",
        "flax>=0.10",
        "optax>=0.2",
        "ray>=2.9",
        "pulp>=2.7",
        # The auto-sharding ILP's default solver: HiGHS in process, several times faster
        # than CBC through PuLP on the same ILPs (docs/auto_sharding.md), same objectives.
        "highspy>=1.7",
        "numpy>=1.26",
        "tqdm>=4.60",
        # Checkpoints (alpa.serialization): the maintained JAX checkpoint library, which writes
        # and reads each shard of a sharded array from the device where it lives.
        "orbax-checkpoint>=0.11",
        # jax.export serializes the programs the driver ships to Ray mesh workers.
        "flatbuffers>=24",
    ],
    extras_require={
        "gpu": ["cupy-cuda12x>=13"],
        # Pictures of plans (plan.draw, python -m alpa.plan_view): the plotting library
        # every scientific Python user already has, rather than an SVG writer of our own.
        "plot": ["matplotlib>=3.8"],
        "test": ["pytest>=8", "pytest-xdist>=3", "ruff>=0.5", "matplotlib>=3.8"],
    },
)
