/* tslint:disable */
/* eslint-disable */
export const memory: WebAssembly.Memory;
export const blockHashes: (a: number, b: number, c: number, d: number, e: number, f: number, g: number) => [number, number, number, number];
export const encodeTokenHeader: (a: number, b: number) => [number, number];
export const hashSeed: (a: number, b: number, c: number, d: number) => bigint;
export const parseTokenHeader: (a: any, b: number, c: number) => [number, number, number, number];
export const readBody: (a: any, b: any) => [number, number, number];
export const route: (a: any) => [number, number, number];
export const sequenceHashes: (a: number, b: number, c: number, d: number, e: number, f: number, g: number) => [number, number, number, number];
export const sequenceHashesOfBlocks: (a: number, b: number) => [number, number];
export const __wbindgen_malloc: (a: number, b: number) => number;
export const __wbindgen_realloc: (a: number, b: number, c: number, d: number) => number;
export const __wbindgen_free: (a: number, b: number, c: number) => void;
export const __wbindgen_exn_store: (a: number) => void;
export const __externref_table_alloc: () => number;
export const __wbindgen_externrefs: WebAssembly.Table;
export const __externref_table_dealloc: (a: number) => void;
export const __wbindgen_start: () => void;
