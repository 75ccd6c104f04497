"""Framework callbacks that trace training with no change to the training loop.

* :mod:`copytrace.integrations.lightning`: ``CopytraceCallback`` for PyTorch Lightning
  (``pip install "copytrace[lightning]"``).
* :mod:`copytrace.integrations.hf`: ``CopytraceTrainerCallback`` for the Hugging Face
  ``Trainer`` (``pip install "copytrace[hf]"``).

Each starts a :class:`copytrace.Trace` when training starts, marks a step after each
optimizer step, stops the trace when training ends and writes the HTML report from the main
process. Under ``COPYTRACE=1`` (or ``copytrace run``) the process is already traced: the
callback then only marks steps, and the report is written by the launch as usual.

The submodules import their framework; import them only where it is installed.
"""

__all__: list[str] = []
