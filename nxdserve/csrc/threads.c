/* OpenMP team affinity for cpu_threads.ThreadBinding (part of kernels.c). */

/* Thread t of the calling thread's n-thread OpenMP team (the caller is t = 0) on CPU cpus[t % ncpus] alone
   (bind = 1), or every thread of the team free to run on any of cpus (bind = 0). Returns how many threads
   were set. */
int omp_bind_team(int n, const int* cpus, int ncpus, int bind) {
    int done = 0;
    _Pragma("omp parallel num_threads(n) reduction(+ : done)")
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        if (bind) {
            CPU_SET(cpus[omp_get_thread_num() % ncpus], &set);
        } else {
            for (int i = 0; i < ncpus; i++) CPU_SET(cpus[i], &set);
        }
        done += sched_setaffinity(0, sizeof(set), &set) == 0;
    }
    return done;
}

