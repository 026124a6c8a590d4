"""Private ``@triton.jit`` pieces shared by the kernels of every op: the fp32 dot policy (:mod:`.dot`), the
gather-and-accumulate steps of sparse rows (:mod:`.gather`), tile schedules (:mod:`.schedule`) and the BlockELL
slots a row-block program covers (:mod:`.slots`).

Kernels import from here rather than from each other, so a helper exists once and an op's folder holds only what is
its own."""
