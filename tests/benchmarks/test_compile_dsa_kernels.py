"""``compile_dsa_kernels``: a DSA kernel compiles for sm_90 without a GPU (the store, the
quickest), and a kernel that cannot compile makes the script fail."""

import compile_dsa_kernels as cdk


def test_the_store_kernel_compiles_for_sm90(capsys):
    assert cdk.main(["--only", "store_index_k_cache ue8m0"]) == 0
    assert "store_index_k_cache ue8m0: REG=" in capsys.readouterr().out


def test_a_kernel_that_cannot_compile_fails_the_run(monkeypatch, capsys):
    name, kernel, types, constexprs = cdk.CASES[6]
    broken = dict(constexprs, BLOCK_D=100)               # not a power of two: tl.arange refuses
    monkeypatch.setattr(cdk, "CASES", [(name + " broken", kernel, types, broken)])
    assert cdk.main([]) == 1
    assert "FAILED" in capsys.readouterr().out
