"""The (H, N, N) bias matrix of the dense backend: entry (i, j) is the table's entry of the offset
j - i (1D) or (dy, dx) (2D, row-major grid), and the table's gradient sums the matrix's gradient
over every pair of that offset."""

import torch

from hf_kernattn.modeling.kernels_common import dense_bias_matrix


def test_dense_bias_matrix_1d_and_2d_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    for n, grid, shape in ((5, None, (3, 9)), (12, (3, 4), (2, 5, 7)), (6, (6, 1), (2, 11, 1))):
        table = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
        got = dense_bias_matrix(table, n, grid)
        want = _reference(table.detach(), n, grid)
        assert got.shape == (shape[0], n, n)
        assert torch.equal(got, want)  # a gather: exact
        upstream = torch.randn(shape[0], n, n, generator=gen, dtype=torch.float64)
        (grad,) = torch.autograd.grad(got, table, upstream)
        ref_table = table.detach().clone().requires_grad_()
        (want_grad,) = torch.autograd.grad(_reference(ref_table, n, grid), ref_table, upstream)
        # sums of at most N^2 products of O(1) values in float64
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=n * n * 1e-15)


def _reference(table: torch.Tensor, n: int, grid) -> torch.Tensor:
    rows = []
    for i in range(n):
        cols = []
        for j in range(n):
            if grid is None:
                cols.append(table[:, j - i + n - 1])
            else:
                (yi, xi), (yj, xj) = divmod(i, grid[1]), divmod(j, grid[1])
                cols.append(table[:, yj - yi + grid[0] - 1, xj - xi + grid[1] - 1])
        rows.append(torch.stack(cols, dim=-1))
    return torch.stack(rows, dim=-2)
