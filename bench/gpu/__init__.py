"""The GPU suite, sized for a short loan (`bash bench/gpu/suite.sh OUTDIR`): suite.py (the plan's budget,
one process a section, the compile caches), results.py (the plan and the rolling result), sections.py (runs
one section), section.py (a section's context and the plain references), kernels.py and models.py (the
sections, by what they measure)."""
