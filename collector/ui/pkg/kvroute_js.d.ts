/* tslint:disable */
/* eslint-disable */

/** Matched leading blocks: a number (all in GPU memory) or cumulative [gpu, cpu, disk]. */
export type Matched = number | [number, number, number];

/** A routing request for `route`. */
export interface RouteRequest {
    /** Full blocks of the prompt and tokens per block. */
    query: { blocks: number; blockSize: number };
    /** The request's tenant, default "default". */
    tenant?: string;
    /** The request's model; instances with `models` not serving it are not eligible. */
    model?: string;
    instances: Array<{
        id: string;
        /** What it serves (tenant default "default"; model "" serves any); absent: any. */
        models?: Array<{ tenant?: string; model: string }>;
        /** Leading blocks held (dp rank 0); or give `ranks`. */
        matched?: Matched;
        ranks?: Array<{ dpRank: number; matched: Matched }>;
        load?: {
            requests?: number;
            prefillTokens?: number;
            decodeTokens?: number;
            /** The engine's own report, for the saturation rule. */
            engine?: { waiting: number; kvUsage: number };
        };
    }>;
    /** The filter's defaults for absent knobs. */
    policy?: {
        gpu?: number; cpu?: number; disk?: number; overlap?: number; request?: number;
        cold?: "decide" | "defer";
        maxWaiting?: number; maxKvUsage?: number;
        maxHitQueueTokens?: number | null;
    };
    /** Seed of the exact-tie break; absent: random. */
    seed?: number;
}

/** Where `route` sends the request. */
export interface RouteDecision {
    best: string;
    bestIndex: number;
    runnerUp: string | null;
    runnerUpIndex: number | null;
    dpRank: number;
    matchedBlocks: number;
}



/** Which body fields `readBody` reads; the filter's defaults when absent. */
export interface BodyOptions {
    /** Fields holding token ids, first present wins. Default ["prompt", "prompt_token_ids", "input_ids"]. */
    tokenFields?: string[];
    /** Default "model". */
    modelField?: string;
    /** Default "cache_salt". */
    cacheSaltField?: string;
    /** Default none. */
    tenantField?: string;
    /** Bodies larger than this throw; the token limit is half of it. Default 1000000. */
    maxBodyBytes?: number;
}

/** What `readBody` found; absent fields are null. */
export interface BodyFields {
    tokens: Uint32Array;
    tokenField: string | null;
    model: string | null;
    cacheSalt: string | null;
    tenant: string | null;
    /** max_completion_tokens, else max_tokens. */
    decodeTokens: number | null;
}



/**
 * Block hashes of every full block of `tokens` (a trailing partial block is not hashed).
 *
 * Throws when `blockSize` is not an integer from 1 to 2^32 − 1.
 */
export function blockHashes(tokens: Uint32Array | number[], block_size: number, lora_name?: string | null, cache_salt?: string | null): BigUint64Array;

/**
 * The header value of `tokens`: base64 of little-endian `u32`s, standard alphabet, padded.
 */
export function encodeTokenHeader(tokens: Uint32Array | number[]): string;

/**
 * The seed of a scope: 1337 plus xxh3 of the LoRA name (seed 0) and of the cache salt
 * (seed 1) when given; an empty string counts as absent.
 */
export function hashSeed(lora_name?: string | null, cache_salt?: string | null): bigint;

/**
 * Token ids from a header value (a string, or its bytes): a decimal comma list (`"1, 2, 3"`) or the base64 (standard
 * or URL-safe, padding optional) of the tokens as little-endian `u32`.
 *
 * Throws on a malformed value or more than `maxTokens` (default 2^20) tokens.
 */
export function parseTokenHeader(value: string | Uint8Array, max_tokens?: number | null): Uint32Array;

/**
 * Reads a JSON request body (`string` or UTF-8 bytes) in one pass: the token ids of the
 * first token field present, and the model, cache salt, tenant and decode budget.
 *
 * Returns `{ tokens: Uint32Array, tokenField, model, cacheSalt, tenant, decodeTokens }`
 * (absent fields are `null`; `tokens` is empty when no token field holds an array). Throws
 * on malformed JSON, a non-object body, a token that is not an integer in `0..2^32`, or a
 * body over `maxBodyBytes`.
 */
export function readBody(body: string | Uint8Array, options: BodyOptions | undefined): BodyFields;

/**
 * Decides where a request goes, as the filter would. `request` is a [`RouteRequest`]
 * object or its JSON text. Returns `null` when nothing is decided: no eligible instance, or
 * a cold request under `cold: "defer"`. Throws with the field at fault on bad input.
 */
export function route(request: RouteRequest | string): RouteDecision | null;

/**
 * Sequence hashes (the chained prefix hashes the index is keyed by) of every full block of
 * `tokens`.
 *
 * Throws when `blockSize` is not an integer from 1 to 2^32 − 1.
 */
export function sequenceHashes(tokens: Uint32Array | number[], block_size: number, lora_name?: string | null, cache_salt?: string | null): BigUint64Array;

/**
 * Sequence hashes chained from block hashes already computed (Dynamo-style
 * `/query_by_hash` input).
 */
export function sequenceHashesOfBlocks(block_hashes: BigUint64Array | bigint[]): BigUint64Array;

export type InitInput = RequestInfo | URL | Response | BufferSource | WebAssembly.Module;

export interface InitOutput {
    readonly memory: WebAssembly.Memory;
    readonly blockHashes: (a: number, b: number, c: number, d: number, e: number, f: number, g: number) => [number, number, number, number];
    readonly encodeTokenHeader: (a: number, b: number) => [number, number];
    readonly hashSeed: (a: number, b: number, c: number, d: number) => bigint;
    readonly parseTokenHeader: (a: any, b: number, c: number) => [number, number, number, number];
    readonly readBody: (a: any, b: any) => [number, number, number];
    readonly route: (a: any) => [number, number, number];
    readonly sequenceHashes: (a: number, b: number, c: number, d: number, e: number, f: number, g: number) => [number, number, number, number];
    readonly sequenceHashesOfBlocks: (a: number, b: number) => [number, number];
    readonly __wbindgen_malloc: (a: number, b: number) => number;
    readonly __wbindgen_realloc: (a: number, b: number, c: number, d: number) => number;
    readonly __wbindgen_free: (a: number, b: number, c: number) => void;
    readonly __wbindgen_exn_store: (a: number) => void;
    readonly __externref_table_alloc: () => number;
    readonly __wbindgen_externrefs: WebAssembly.Table;
    readonly __externref_table_dealloc: (a: number) => void;
    readonly __wbindgen_start: () => void;
}

export type SyncInitInput = BufferSource | WebAssembly.Module;

/**
 * Instantiates the given `module`, which can either be bytes or
 * a precompiled `WebAssembly.Module`.
 *
 * @param {{ module: SyncInitInput }} module - Passing `SyncInitInput` directly is deprecated.
 *
 * @returns {InitOutput}
 */
export function initSync(module: { module: SyncInitInput } | SyncInitInput): InitOutput;

/**
 * If `module_or_path` is {RequestInfo} or {URL}, makes a request and
 * for everything else, calls `WebAssembly.instantiate` directly.
 *
 * @param {{ module_or_path: InitInput | Promise<InitInput> }} module_or_path - Passing `InitInput` directly is deprecated.
 *
 * @returns {Promise<InitOutput>}
 */
export default function __wbg_init (module_or_path?: { module_or_path: InitInput | Promise<InitInput> } | InitInput | Promise<InitInput>): Promise<InitOutput>;
