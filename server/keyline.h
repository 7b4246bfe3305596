/* One line of an authorized-keys file (auth.c; the fuzzer fuzz_keys):
 * "<z85 public key> [admin] [# comment]". Its own module so that the parser
 * can be fuzzed without the server around it. */
#ifndef KVS_KEYLINE_H
#define KVS_KEYLINE_H

#include <stdbool.h>
#include <stdint.h>

#define KVS_KEY_Z85 40

/* line: NUL-terminated, any length, changed in place. 1 with the key in pub
 * and its flag in *admin, 0 for a blank or comment line, -1 for a line that
 * is not a key (a wrong length, not z85, an unknown flag, extra words). A
 * comment starts at a '#' that begins a word (z85 keys contain '#'). */
int kvs_keyline_parse(char *line, uint8_t pub[32], bool *admin);

#endif
