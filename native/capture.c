/*
 * Capture of one graph tensor during llama.cpp's evaluation, for the stage engine; and the
 * restore of another to values the caller gives.
 *
 * llama.cpp calls an evaluation callback for every node of the compute graph (about 350 per
 * decode step for 10 layers), first asking whether we want the node's data, then handing it
 * over once computed. A stage wants exactly one node: the residual stream after its last layer
 * ("l_out-<n-1>"). In C the per-node cost is one string compare; the same callback in Python
 * costs several percent of decode speed.
 *
 * A restore overwrites one node, once computed, with the caller's rows, before any later node
 * reads it. Gemma 1 and 2 multiply their input by sqrt(n_embd) whatever it is; a later stage's
 * input is a hidden state that must go in unscaled, so the stage restores "inp_scaled" to the
 * input it was given (bit for bit: no division that could round).
 *
 * Only four stable ggml functions are used, declared here, so the file builds without the ggml
 * headers. They resolve at load time against the libggml-base.so.0 that libllama already
 * loaded (the loader promotes it to global first): a second copy of ggml would have its own
 * backend registry and fail silently.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

struct ggml_tensor;
extern const char *ggml_get_name(const struct ggml_tensor *tensor);
extern size_t ggml_nbytes(const struct ggml_tensor *tensor);
extern bool ggml_is_contiguous(const struct ggml_tensor *tensor);
extern void ggml_backend_tensor_get(const struct ggml_tensor *tensor, void *data, size_t offset,
                                    size_t size);
extern void ggml_backend_tensor_set(struct ggml_tensor *tensor, const void *data, size_t offset,
                                    size_t size);

typedef struct {
    char name[64];      /* the tensor to capture */
    uint8_t *dst;       /* where its rows go */
    size_t capacity;    /* bytes available at dst */
    size_t offset;      /* bytes written so far; grows across micro-batches */
    int32_t status;     /* 0 ok, 1 overflow, 2 not contiguous, 3 restore past its rows */
    int32_t hits;       /* how many times the tensor was seen */
    char restore[64];   /* the tensor to overwrite, or "" */
    const uint8_t *src; /* its rows */
    size_t src_size;    /* bytes at src */
    size_t src_offset;  /* bytes restored so far; grows across micro-batches */
    int32_t restored;   /* how many times it was overwritten */
} meshagent_capture;

static bool restore(meshagent_capture *c, struct ggml_tensor *t) {
    if (!ggml_is_contiguous(t)) {
        c->status = 2;
        return true;
    }
    size_t n = ggml_nbytes(t);
    if (c->src_offset + n > c->src_size) {
        c->status = 3;
        return true;
    }
    ggml_backend_tensor_set(t, c->src + c->src_offset, 0, n);
    c->src_offset += n;
    c->restored += 1;
    return true;
}

bool meshagent_capture_eval(struct ggml_tensor *t, bool ask, void *user_data) {
    meshagent_capture *c = (meshagent_capture *)user_data;
    const char *name = ggml_get_name(t);
    if (c->restore[0] != '\0' && strncmp(name, c->restore, sizeof(c->restore)) == 0) {
        return ask ? true : restore(c, t);
    }
    if (c->name[0] == '\0' || strncmp(name, c->name, sizeof(c->name)) != 0) {
        return ask ? false : true;
    }
    if (ask) {
        return true;
    }
    c->hits += 1;
    if (!ggml_is_contiguous(t)) {
        c->status = 2;
        return true;
    }
    size_t n = ggml_nbytes(t);
    if (c->offset + n > c->capacity) {
        c->status = 1;
        return true;
    }
    ggml_backend_tensor_get(t, c->dst + c->offset, 0, n);
    c->offset += n;
    return true;
}

/* The layout of meshagent_capture this file was built for; the loader checks it. */
int32_t meshagent_capture_abi(void) { return (int32_t)sizeof(meshagent_capture); }
