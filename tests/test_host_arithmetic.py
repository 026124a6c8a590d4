"""The host's launch arithmetic (:func:`sparsefuse._backend.cdiv`, :func:`~sparsefuse._backend.next_power_of_2`)
gives what ``triton.cdiv`` and ``triton.next_power_of_2`` give, edge values included: every grid and block size the
launchers compute stays the same."""

import triton

from sparsefuse._backend import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    for n in [*range(-3, 300), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 7]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
