# Declarations of the libibverbs C API (<infiniband/verbs.h>), C names unchanged.
# Only what ud_transport uses: devices, ports, GIDs, PD, MR, CQ, completion
# channel, UD QP, AH, posting and polling. Everything is nogil.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "<infiniband/verbs.h>" nogil:

    # ---- enums ------------------------------------------------------------------------

    enum ibv_port_state:
        IBV_PORT_NOP
        IBV_PORT_DOWN
        IBV_PORT_INIT
        IBV_PORT_ARMED
        IBV_PORT_ACTIVE
        IBV_PORT_ACTIVE_DEFER

    enum ibv_mtu:
        IBV_MTU_256
        IBV_MTU_512
        IBV_MTU_1024
        IBV_MTU_2048
        IBV_MTU_4096

    enum:
        IBV_LINK_LAYER_UNSPECIFIED
        IBV_LINK_LAYER_INFINIBAND
        IBV_LINK_LAYER_ETHERNET

    enum ibv_gid_type:
        IBV_GID_TYPE_IB
        IBV_GID_TYPE_ROCE_V1
        IBV_GID_TYPE_ROCE_V2

    enum ibv_access_flags:
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_WRITE
        IBV_ACCESS_REMOTE_READ

    enum ibv_qp_type:
        IBV_QPT_RC
        IBV_QPT_UC
        IBV_QPT_UD

    enum ibv_qp_state:
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_SQD
        IBV_QPS_SQE
        IBV_QPS_ERR
        IBV_QPS_UNKNOWN

    enum ibv_qp_attr_mask:
        IBV_QP_STATE
        IBV_QP_CUR_STATE
        IBV_QP_PKEY_INDEX
        IBV_QP_PORT
        IBV_QP_QKEY
        IBV_QP_SQ_PSN

    enum ibv_wr_opcode:
        IBV_WR_SEND

    enum ibv_send_flags:
        IBV_SEND_FENCE
        IBV_SEND_SIGNALED
        IBV_SEND_SOLICITED
        IBV_SEND_INLINE

    enum ibv_wc_status:
        IBV_WC_SUCCESS
        IBV_WC_LOC_LEN_ERR
        IBV_WC_LOC_QP_OP_ERR
        IBV_WC_LOC_PROT_ERR
        IBV_WC_WR_FLUSH_ERR
        IBV_WC_GENERAL_ERR

    enum ibv_wc_opcode:
        IBV_WC_SEND
        IBV_WC_RECV

    enum ibv_wc_flags:
        IBV_WC_GRH
        IBV_WC_WITH_IMM

    # ---- structs ------------------------------------------------------------------------

    union ibv_gid:
        uint8_t raw[16]

    struct ibv_device:
        char name[64]

    struct ibv_context:
        ibv_device *device
        int num_comp_vectors

    struct ibv_device_attr:
        char fw_ver[64]
        uint64_t node_guid
        uint32_t vendor_id
        uint32_t vendor_part_id
        int max_qp
        int max_qp_wr
        int max_sge
        int max_cq
        int max_cqe
        int max_mr
        int max_pd
        int max_ah
        uint8_t phys_port_cnt

    struct ibv_port_attr:
        ibv_port_state state
        ibv_mtu max_mtu
        ibv_mtu active_mtu
        int gid_tbl_len
        uint32_t max_msg_sz
        uint16_t lid
        uint8_t link_layer

    struct ibv_gid_entry:
        ibv_gid gid
        uint32_t gid_index
        uint32_t port_num
        uint32_t gid_type
        uint32_t ndev_ifindex

    struct ibv_pd:
        ibv_context *context
        uint32_t handle

    struct ibv_mr:
        ibv_context *context
        ibv_pd *pd
        void *addr
        size_t length
        uint32_t handle
        uint32_t lkey
        uint32_t rkey

    struct ibv_comp_channel:
        ibv_context *context
        int fd
        int refcnt

    struct ibv_cq:
        ibv_context *context
        ibv_comp_channel *channel
        void *cq_context
        int cqe

    struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class

    struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num

    struct ibv_ah:
        ibv_context *context
        ibv_pd *pd
        uint32_t handle

    struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data

    struct ibv_srq:
        pass

    struct ibv_qp_init_attr:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        ibv_qp_cap cap
        ibv_qp_type qp_type
        int sq_sig_all

    struct ibv_qp:
        ibv_context *context
        void *qp_context
        ibv_pd *pd
        ibv_cq *send_cq
        ibv_cq *recv_cq
        uint32_t handle
        uint32_t qp_num
        ibv_qp_state state
        ibv_qp_type qp_type

    struct ibv_qp_attr:
        ibv_qp_state qp_state
        ibv_qp_state cur_qp_state
        uint32_t qkey
        uint32_t sq_psn
        ibv_qp_cap cap
        uint16_t pkey_index
        uint8_t port_num

    struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    # the anonymous members of ibv_send_wr.wr (only the UD one is used)
    struct ud:
        ibv_ah *ah
        uint32_t remote_qpn
        uint32_t remote_qkey

    union wr:
        ud ud

    struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr *next
        ibv_sge *sg_list
        int num_sge
        ibv_wr_opcode opcode
        unsigned int send_flags
        wr wr

    struct ibv_recv_wr:
        uint64_t wr_id
        ibv_recv_wr *next
        ibv_sge *sg_list
        int num_sge

    struct ibv_wc:
        uint64_t wr_id
        ibv_wc_status status
        ibv_wc_opcode opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t qp_num
        uint32_t src_qp
        unsigned int wc_flags
        uint16_t pkey_index
        uint16_t slid
        uint8_t sl
        uint8_t dlid_path_bits

    # ---- functions ------------------------------------------------------------------------

    ibv_device **ibv_get_device_list(int *num_devices)
    void ibv_free_device_list(ibv_device **list)
    const char *ibv_get_device_name(ibv_device *device)
    ibv_context *ibv_open_device(ibv_device *device)
    int ibv_close_device(ibv_context *context)
    int ibv_query_device(ibv_context *context, ibv_device_attr *device_attr)
    int ibv_query_port(ibv_context *context, uint8_t port_num, ibv_port_attr *port_attr)
    int ibv_query_gid(ibv_context *context, uint8_t port_num, int index, ibv_gid *gid)
    int ibv_query_gid_ex(ibv_context *context, uint32_t port_num, uint32_t gid_index, ibv_gid_entry *entry, uint32_t flags)
    ssize_t ibv_query_gid_table(ibv_context *context, ibv_gid_entry *entries, size_t max_entries, uint32_t flags)

    const char *ibv_port_state_str(ibv_port_state port_state)
    const char *ibv_wc_status_str(ibv_wc_status status)

    ibv_pd *ibv_alloc_pd(ibv_context *context)
    int ibv_dealloc_pd(ibv_pd *pd)

    ibv_mr *ibv_reg_mr(ibv_pd *pd, void *addr, size_t length, int access)
    int ibv_dereg_mr(ibv_mr *mr)

    ibv_comp_channel *ibv_create_comp_channel(ibv_context *context)
    int ibv_destroy_comp_channel(ibv_comp_channel *channel)
    ibv_cq *ibv_create_cq(ibv_context *context, int cqe, void *cq_context, ibv_comp_channel *channel, int comp_vector)
    int ibv_destroy_cq(ibv_cq *cq)
    int ibv_poll_cq(ibv_cq *cq, int num_entries, ibv_wc *wc)
    int ibv_req_notify_cq(ibv_cq *cq, int solicited_only)
    int ibv_get_cq_event(ibv_comp_channel *channel, ibv_cq **cq, void **cq_context)
    void ibv_ack_cq_events(ibv_cq *cq, unsigned int nevents)

    ibv_qp *ibv_create_qp(ibv_pd *pd, ibv_qp_init_attr *qp_init_attr)
    int ibv_modify_qp(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask)
    int ibv_query_qp(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask, ibv_qp_init_attr *init_attr)
    int ibv_destroy_qp(ibv_qp *qp)
    int ibv_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad_wr)
    int ibv_post_recv(ibv_qp *qp, ibv_recv_wr *wr, ibv_recv_wr **bad_wr)

    ibv_ah *ibv_create_ah(ibv_pd *pd, ibv_ah_attr *attr)
    int ibv_destroy_ah(ibv_ah *ah)
