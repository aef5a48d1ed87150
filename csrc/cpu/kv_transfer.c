/* native CPU transfer kernels: written with the kernels issue */
