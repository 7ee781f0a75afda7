-- vgpumgr schema at revision 0018_fleet_best_fit: what `alembic upgrade head` leaves in an empty SQLite database.
-- Written by `scripts/schema_snapshot.py`; tests/test_db.py checks it against the migrations.
CREATE TABLE alembic_version (
	version_num VARCHAR(32) NOT NULL, 
	CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);
CREATE TABLE hosts (
	id INTEGER NOT NULL, 
	name VARCHAR(255) NOT NULL, 
	created_at DATETIME NOT NULL, 
	last_seen DATETIME NOT NULL, code_version VARCHAR(32), code_schema INTEGER, 
	PRIMARY KEY (id), 
	UNIQUE (name)
);
CREATE TABLE gpus (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	address VARCHAR(16) NOT NULL, 
	model VARCHAR(255) NOT NULL, 
	uuid VARCHAR(64), 
	serial VARCHAR(64), 
	vendor_id VARCHAR(8), 
	device_id VARCHAR(8), 
	first_seen DATETIME NOT NULL, 
	last_seen DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_gpus_host_address UNIQUE (host_id, address), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE vgpu_types (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	gpu_model VARCHAR(255) NOT NULL, 
	type_id VARCHAR(64) NOT NULL, 
	name VARCHAR(255) NOT NULL, 
	backend VARCHAR(32) NOT NULL, 
	series VARCHAR(1), 
	framebuffer_mb INTEGER, 
	max_instances INTEGER, 
	mig_slices INTEGER, 
	updated_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_vgpu_types_host_model_type UNIQUE (host_id, gpu_model, type_id), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE vms (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	name VARCHAR(64) NOT NULL, 
	uuid VARCHAR(36), 
	state VARCHAR(32) NOT NULL, 
	created_at DATETIME NOT NULL, 
	updated_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_vms_host_name UNIQUE (host_id, name), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE licence_pools (
	id INTEGER NOT NULL, 
	name VARCHAR(64) NOT NULL, 
	edition VARCHAR(8) NOT NULL, 
	seats INTEGER NOT NULL, 
	unit VARCHAR(8) NOT NULL, 
	expires DATE, 
	created_at DATETIME NOT NULL, delivery VARCHAR(8), 
	PRIMARY KEY (id), 
	CONSTRAINT ck_licence_pools_seats CHECK (seats >= 0), 
	CONSTRAINT ck_licence_pools_unit CHECK (unit IN ('vm', 'gpu')), 
	CONSTRAINT ck_licence_pools_edition CHECK (edition IN ('vApps', 'vPC', 'vCS', 'vWS')), 
	UNIQUE (name)
);
CREATE TABLE licence_leases (
	id INTEGER NOT NULL, 
	pool_id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	vm_id INTEGER NOT NULL, 
	gpu_id INTEGER, 
	holder VARCHAR(64) NOT NULL, 
	acquired_at DATETIME NOT NULL, 
	released_at DATETIME, 
	PRIMARY KEY (id), 
	FOREIGN KEY(pool_id) REFERENCES licence_pools (id) ON DELETE RESTRICT, 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE, 
	FOREIGN KEY(vm_id) REFERENCES vms (id) ON DELETE CASCADE, 
	FOREIGN KEY(gpu_id) REFERENCES gpus (id) ON DELETE SET NULL
);
CREATE UNIQUE INDEX uq_licence_leases_held ON licence_leases (pool_id, holder) WHERE released_at IS NULL;
CREATE INDEX ix_licence_leases_vm ON licence_leases (vm_id);
CREATE TABLE allocations (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	uuid VARCHAR(36), 
	pci_address VARCHAR(16), 
	backend VARCHAR(32) NOT NULL, 
	parent VARCHAR(64) NOT NULL, 
	gpu_id INTEGER, 
	type_id VARCHAR(64) NOT NULL, 
	type_name VARCHAR(255), 
	series VARCHAR(16), 
	vm_id INTEGER, 
	lease_id INTEGER, 
	state VARCHAR(16) NOT NULL, 
	idempotency_key VARCHAR(128), 
	detail JSON, 
	created_at DATETIME NOT NULL, 
	activated_at DATETIME, 
	released_at DATETIME, owner_host VARCHAR(255), owner_boot VARCHAR(36), owner_pid INTEGER, owner_started BIGINT, lease_until DATETIME, 
	PRIMARY KEY (id), 
	CONSTRAINT ck_allocations_state CHECK (state IN ('reserved', 'active', 'released')), 
	CONSTRAINT uq_allocations_host_idem UNIQUE (host_id, idempotency_key), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE, 
	FOREIGN KEY(gpu_id) REFERENCES gpus (id) ON DELETE SET NULL, 
	FOREIGN KEY(vm_id) REFERENCES vms (id) ON DELETE SET NULL, 
	FOREIGN KEY(lease_id) REFERENCES licence_leases (id) ON DELETE SET NULL
);
CREATE UNIQUE INDEX uq_allocations_live_uuid ON allocations (host_id, uuid) WHERE state IN ('reserved', 'active');
CREATE UNIQUE INDEX uq_allocations_live_pci ON allocations (host_id, pci_address) WHERE state IN ('reserved', 'active');
CREATE INDEX ix_allocations_host_state ON allocations (host_id, state);
CREATE INDEX ix_allocations_vm ON allocations (vm_id);
CREATE INDEX ix_allocations_lease ON allocations (lease_id);
CREATE TABLE audit_events (
	seq INTEGER NOT NULL, 
	at DATETIME NOT NULL, 
	host VARCHAR(255) NOT NULL, 
	actor VARCHAR(255) NOT NULL, 
	action VARCHAR(64) NOT NULL, 
	outcome VARCHAR(16) NOT NULL, 
	gpu VARCHAR(64), 
	vm VARCHAR(64), 
	vgpu VARCHAR(64), 
	error TEXT, 
	detail JSON, 
	prev_hash VARCHAR(64) NOT NULL, 
	hash VARCHAR(64) NOT NULL, 
	PRIMARY KEY (seq), 
	CONSTRAINT ck_audit_events_outcome CHECK (outcome IN ('ok', 'failed', 'warning')), 
	UNIQUE (hash)
);
CREATE INDEX ix_audit_events_at ON audit_events (at);
CREATE INDEX ix_audit_events_vm ON audit_events (vm);
CREATE INDEX ix_audit_events_gpu ON audit_events (gpu);
CREATE TABLE audit_head (
	id INTEGER NOT NULL, 
	seq INTEGER NOT NULL, 
	hash VARCHAR(64) NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT ck_audit_head_single CHECK (id = 1)
);
CREATE TABLE api_tokens (
	id INTEGER NOT NULL, 
	name VARCHAR(64) NOT NULL, 
	role VARCHAR(16) NOT NULL, 
	secret_sha256 VARCHAR(64) NOT NULL, 
	created_at DATETIME NOT NULL, 
	revoked_at DATETIME, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_api_tokens_name UNIQUE (name), 
	CONSTRAINT uq_api_tokens_secret UNIQUE (secret_sha256), 
	CONSTRAINT ck_api_tokens_role CHECK (role IN ('admin', 'operator', 'hook', 'auditor'))
);
CREATE UNIQUE INDEX uq_audit_events_prev_hash ON audit_events (prev_hash);
CREATE INDEX ix_allocations_leased ON allocations (host_id) WHERE owner_pid IS NOT NULL;
CREATE TABLE idempotency_keys (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	"key" VARCHAR(128) NOT NULL, 
	caller VARCHAR(255) NOT NULL, 
	fingerprint VARCHAR(64) NOT NULL, 
	nonce VARCHAR(32) NOT NULL, 
	status INTEGER, 
	response JSON, 
	owner_boot VARCHAR(36), 
	owner_pid INTEGER, 
	owner_started BIGINT, 
	created_at DATETIME NOT NULL, 
	expires_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_idempotency_keys_host_key UNIQUE (host_id, "key"), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE INDEX ix_idempotency_keys_expires ON idempotency_keys (expires_at);
CREATE TABLE gpu_boot_state (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	address VARCHAR(16) NOT NULL, 
	numvfs INTEGER, 
	mig_enabled BOOLEAN, 
	updated_at DATETIME NOT NULL, vgpu_mode VARCHAR(16), vendor_state JSON, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_gpu_boot_state_host_address UNIQUE (host_id, address), 
	CONSTRAINT ck_gpu_boot_state_numvfs CHECK (numvfs IS NULL OR numvfs >= 0), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE mig_gpu_instances (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	gpu VARCHAR(16) NOT NULL, 
	profile VARCHAR(32) NOT NULL, 
	profile_id INTEGER NOT NULL, 
	start INTEGER NOT NULL, 
	size INTEGER NOT NULL, 
	compute_instance BOOLEAN DEFAULT 0 NOT NULL, 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_mig_gpu_instances_host_gpu_start UNIQUE (host_id, gpu, start), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE host_cordons (
	host_id INTEGER NOT NULL, 
	reason TEXT, 
	cordoned_by VARCHAR(255) NOT NULL, 
	cordoned_at DATETIME NOT NULL, 
	PRIMARY KEY (host_id), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE INDEX ix_vms_name ON vms (name);
CREATE TABLE fleet_hosts (
	host_id INTEGER NOT NULL, 
	endpoint VARCHAR(512), 
	migration_uri VARCHAR(512), 
	driver_version VARCHAR(64), 
	version VARCHAR(32) NOT NULL, 
	heartbeat_s FLOAT NOT NULL, 
	stale_after_s FLOAT NOT NULL, 
	heartbeat_at DATETIME NOT NULL, 
	generation BIGINT NOT NULL, 
	gpus INTEGER NOT NULL, 
	vgpus INTEGER NOT NULL, types_generation BIGINT, fit_generation BIGINT, 
	PRIMARY KEY (host_id), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE fleet_gpus (
	host_id INTEGER NOT NULL, 
	address VARCHAR(16) NOT NULL, 
	model VARCHAR(255) NOT NULL, 
	vendor_id VARCHAR(8) NOT NULL, 
	device_id VARCHAR(8) NOT NULL, 
	subsystem_vendor_id VARCHAR(8), 
	subsystem_device_id VARCHAR(8), 
	driver VARCHAR(64), 
	mode VARCHAR(16) NOT NULL, 
	numa_node INTEGER, 
	vgpus INTEGER NOT NULL, 
	published_at DATETIME NOT NULL, region_mb INTEGER, used_mb INTEGER, room_at DATETIME, 
	PRIMARY KEY (host_id, address), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE fleet_capacity (
	host_id INTEGER NOT NULL, 
	gpu VARCHAR(16) NOT NULL, 
	type_id VARCHAR(64) NOT NULL, 
	name VARCHAR(255) NOT NULL, 
	short VARCHAR(128) NOT NULL, 
	backend VARCHAR(32) NOT NULL, 
	framebuffer_mb INTEGER, 
	model VARCHAR(255) NOT NULL, 
	device_id VARCHAR(8) NOT NULL, 
	free INTEGER NOT NULL, 
	used INTEGER NOT NULL, 
	max INTEGER, 
	PRIMARY KEY (host_id, gpu, type_id), 
	CONSTRAINT fk_fleet_capacity_gpu FOREIGN KEY(host_id, gpu) REFERENCES fleet_gpus (host_id, address) ON DELETE CASCADE
);
CREATE INDEX ix_fleet_capacity_short ON fleet_capacity (short);
CREATE TABLE vgpumgr_schema (
	id INTEGER NOT NULL, 
	contract_level INTEGER NOT NULL, 
	changed_by VARCHAR(255), 
	PRIMARY KEY (id)
);
CREATE TABLE gpu_scheduler_intents (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	address VARCHAR(16) NOT NULL, 
	policy VARCHAR(16) NOT NULL, 
	timeslice_ms INTEGER, 
	frequency_hz INTEGER, 
	avg_factor INTEGER, 
	applied_at DATETIME, 
	pending_reason VARCHAR(512), 
	updated_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_gpu_scheduler_intents_host_address UNIQUE (host_id, address), 
	CONSTRAINT ck_gpu_scheduler_intents_policy CHECK (policy IN ('best-effort', 'equal-share', 'fixed-share')), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE licence_deliveries (
	id INTEGER NOT NULL, 
	host_id INTEGER NOT NULL, 
	vm VARCHAR(64) NOT NULL, 
	vm_uuid VARCHAR(36), 
	mode VARCHAR(8), 
	method VARCHAR(8), 
	fingerprint VARCHAR(32), 
	server VARCHAR(512), 
	delivered_at DATETIME, 
	started_at DATETIME, 
	first_licensed_at DATETIME, 
	error TEXT, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_licence_deliveries_host_vm UNIQUE (host_id, vm), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE TABLE guest_telemetry (
	id INTEGER NOT NULL, 
	vm VARCHAR(64), 
	pool_id INTEGER, 
	enabled BOOLEAN NOT NULL, 
	changed_at DATETIME NOT NULL, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_guest_telemetry_vm UNIQUE (vm), 
	CONSTRAINT uq_guest_telemetry_pool UNIQUE (pool_id), 
	CONSTRAINT ck_guest_telemetry_one CHECK ((vm IS NULL) <> (pool_id IS NULL)), 
	FOREIGN KEY(pool_id) REFERENCES licence_pools (id) ON DELETE CASCADE
);
CREATE TABLE fleet_host_types (
	host_id INTEGER NOT NULL, 
	short VARCHAR(128) NOT NULL, 
	host VARCHAR(255) NOT NULL, 
	name VARCHAR(255) NOT NULL, 
	model VARCHAR(255) NOT NULL, 
	device_id VARCHAR(8) NOT NULL, 
	framebuffer_mb INTEGER, 
	boards INTEGER NOT NULL, 
	gpus INTEGER NOT NULL, 
	open_gpus INTEGER NOT NULL, 
	free INTEGER NOT NULL, 
	used INTEGER NOT NULL, 
	max INTEGER NOT NULL, tightest_mb INTEGER, 
	PRIMARY KEY (host_id, short), 
	FOREIGN KEY(host_id) REFERENCES hosts (id) ON DELETE CASCADE
);
CREATE INDEX ix_fleet_host_types_pack ON fleet_host_types (short, free, host) WHERE free > 0;
CREATE INDEX ix_fleet_host_types_spread ON fleet_host_types (short, (-free), host) WHERE free > 0;
CREATE INDEX ix_fleet_host_types_boards ON fleet_host_types (short) WHERE boards > 1;
CREATE INDEX ix_fleet_hosts_unsummarized ON fleet_hosts (host_id) WHERE types_generation IS NULL OR types_generation <> generation;
CREATE INDEX ix_fleet_host_types_room ON fleet_host_types (short, open_gpus, free);
CREATE INDEX ix_fleet_gpus_room ON fleet_gpus ((region_mb - used_mb)) WHERE vgpus > 0;
CREATE INDEX ix_fleet_gpus_unroomed ON fleet_gpus (host_id) WHERE room_at IS NULL OR room_at <> published_at;
CREATE INDEX ix_fleet_gpus_held ON fleet_gpus (vgpus, host_id, address) WHERE vgpus > 0;
CREATE INDEX ix_fleet_capacity_short_gpu ON fleet_capacity (short, host_id, gpu);
CREATE INDEX ix_fleet_host_types_fit ON fleet_host_types (short, tightest_mb, free, host) WHERE free > 0;
CREATE INDEX ix_fleet_hosts_unfit ON fleet_hosts (host_id) WHERE fit_generation IS NULL OR fit_generation <> generation;
INSERT INTO "alembic_version" VALUES('0018_fleet_best_fit');
INSERT INTO "audit_head" VALUES(1,0,'0000000000000000000000000000000000000000000000000000000000000000');
INSERT INTO "vgpumgr_schema" VALUES(1,0,NULL);
