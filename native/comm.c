/* The communicator: made once per rank over a transport, given its peers' addresses, and
 * holding what lasts between calls. */
#include "engine_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void udt_comm_interrupt(struct udt_comm *comm)
{
    __atomic_store_n(&comm->interrupted, 1, __ATOMIC_RELEASE);
}

void udt_comm_set_wait_hook(struct udt_comm *comm, udt_wait_hook hook, void *arg)
{
    comm->wait_hook = hook;
    comm->wait_hook_arg = arg;
}

struct udt_comm *udt_comm_create(struct udt_transport *transport, uint32_t rank, uint32_t world_size, uint64_t session_id,
                                 const struct udt_engine_options *options, struct udt_error *error)
{
    if (world_size == 0 || rank >= world_size || world_size >= UDT_NO_RANK) {
        udt_error_check(error, "rank %u is not in a world of %u", rank, world_size);
        return NULL;
    }
    if (world_size > UDT_MAX_WORLD) {
        udt_error_check(error, "world sizes above %d are not supported (got %u)", UDT_MAX_WORLD, world_size);
        return NULL;
    }
    uint32_t max_chunk = transport->max_datagram_bytes - UDT_WIRE_HEADER_BYTES;
    if (options->chunk_bytes == 0 || options->chunk_bytes > max_chunk) {
        udt_error_check(error, "chunk_bytes %u must be between 1 and %u (the transport's datagram size minus the %u-byte header)",
                 options->chunk_bytes, max_chunk, UDT_WIRE_HEADER_BYTES);
        return NULL;
    }
    struct udt_comm *comm = calloc(1, sizeof *comm);
    if (comm) {
        comm->staging = malloc((size_t)SEND_BATCH * options->chunk_bytes);
        comm->peers = calloc(world_size, sizeof *comm->peers);
        comm->geometry = calloc(3 * ((size_t)world_size + 1), sizeof *comm->geometry); /* chunk_base, block_first, send_first */
        comm->block_scratch = calloc(world_size, sizeof *comm->block_scratch);
    }
    if (!comm || !comm->staging || !comm->peers || !comm->geometry || !comm->block_scratch) {
        if (comm) {
            free(comm->staging);
            free(comm->peers);
            free(comm->geometry);
            free(comm->block_scratch);
            free(comm);
        }
        udt_error_check(error, "out of memory");
        return NULL;
    }
    comm->transport = transport;
    comm->rank = rank;
    comm->world_size = world_size;
    comm->session_id = session_id;
    comm->options = *options;
    if (options->end_repeats > UDT_MAX_END_REPEATS) {
        udt_error_check(error, "end_repeats %u must be at most %d", options->end_repeats, UDT_MAX_END_REPEATS);
        free(comm->staging);
        free(comm->peers);
        free(comm->geometry);
        free(comm->block_scratch);
        free(comm);
        return NULL;
    }
    if (comm->options.end_repeats == 0)
        comm->options.end_repeats = 1;
    if (comm->options.agree_resend_us == 0)
        comm->options.agree_resend_us = 1000;
    if (comm->options.join_timeout_ms == 0)
        comm->options.join_timeout_ms = 300000;
    return comm;
}

int udt_comm_set_peers(struct udt_comm *comm, const uint8_t *addresses, size_t length, uint32_t address_bytes)
{
    if (address_bytes == 0 || length != (size_t)address_bytes * comm->world_size) {
        udt_error_check(&comm->error, "set_peers: %zu bytes of addresses for %u ranks of %u bytes each (want %zu)",
                        length, comm->world_size, address_bytes, (size_t)address_bytes * comm->world_size);
        return -EINVAL;
    }
    int rc = udt_transport_set_peers(comm->transport, addresses, address_bytes, comm->world_size);
    if (rc < 0)
        comm->error = comm->transport->error;
    return rc;
}

void udt_comm_destroy(struct udt_comm *comm)
{
    if (!comm)
        return;
    udt_transport_destroy(comm->transport);
    free(comm->scratch);
    free(comm->rank_rows);
    free(comm->chunk_state);
    free(comm->step_memory);
    free(comm->geometry);
    free(comm->block_scratch);
    free(comm->peers);
    free(comm->staging);
    free(comm);
}

const struct udt_error *udt_comm_error(const struct udt_comm *comm) { return &comm->error; }

int udt_comm_set_sequence(struct udt_comm *comm, uint32_t sequence)
{
    if (comm->call.phase != PHASE_IDLE)
        return -1;
    comm->sequence = sequence;
    return 0;
}

uint32_t udt_comm_chunk_bytes(const struct udt_comm *comm) { return comm->options.chunk_bytes; }

uint32_t udt_comm_sequence(const struct udt_comm *comm) { return comm->sequence; }
