"""Private ``@triton.jit`` pieces shared by the kernels of every op: the fp32 dot policy (:mod:`.dot`), the
gather-and-accumulate steps of sparse rows (:mod:`.gather`), tile schedules (:mod:`.schedule`), the BlockELL
slots a row-block program covers (:mod:`.slots`), the ReLU family's gate tests (:mod:`.gates`), and the sparse
core's launch limits, knobs of the planner's config (:mod:`.limits`).

Kernels import from here rather than from each other, so a helper exists once and an op's folder holds only what is
its own."""
