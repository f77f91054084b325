"""The GPU check kit: everything rlhf needs checked on a CUDA GPU, in one call of the lent machine.

``bash tools/gpu_check.sh`` is the entry point. Here, on a CPU machine with a package registry, it
builds a wheel bundle (`bundle`: this checkout and the packages the device image lacks) into an
ignored folder; on the device, which has no network, it installs that bundle and runs the checks
(`checks`) as subprocesses with a timeout each inside one wall-clock budget (`runner`), writing a
JSON file, a markdown table and a log (`report`). ``--dry-run`` runs the same checks at toy sizes on
a CPU, so the kit is tested where CI runs (tests/gpu_kit/).

Run as a package from the repository root: ``python3 -m tools.gpu_kit {bundle,plan,run,check}``.
"""
