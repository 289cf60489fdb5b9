/* Shared by the standalone kernel checks (qgemm_check.c, qgemm_i8_check.c), after kernels.c: run `kernel` again with
   greedy tokens asked for (nxd_qgemm_args.argmax) over all but the last column, and return whether each row's token is
   the first largest of those outputs as the first call wrote them to `out`. */
static int greedy_tokens_match(void (*kernel)(const nxd_qgemm_args*), nxd_qgemm_args* a, const float* out) {
    const int64_t M = a->M, N = a->N, cols = N > 1 ? N - 1 : N;
    int64_t* tokens = malloc(sizeof(int64_t) * (size_t)(M > 0 ? M : 1));
    a->argmax = tokens;
    a->argmax_cols = cols;
    kernel(a);
    a->argmax = NULL;
    int match = 1;
    for (int64_t m = 0; m < M; m++) {
        int64_t first = 0;
        for (int64_t n = 1; n < cols; n++)
            if (out[m * N + n] > out[m * N + first]) first = n;
        match &= tokens[m] == first;
    }
    free(tokens);
    return match;
}
