/* authorized-keys lines: see keyline.h. */
#include "keyline.h"

#include <string.h>
#include <zmq.h>

static bool space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

int kvs_keyline_parse(char *line, uint8_t pub[32], bool *admin)
{
	for (char *h = line; *h; h++)
		if (*h == '#' && (h == line || h[-1] == ' ' || h[-1] == '\t')) {
			*h = '\0';
			break;
		}
	char *words[3];
	int nw = 0;
	for (char *p = line; *p;) {
		while (space(*p))
			*p++ = '\0';
		if (!*p)
			break;
		if (nw == 3)
			return -1; /* more words than "<key> admin" */
		words[nw++] = p;
		while (*p && !space(*p))
			p++;
	}
	if (nw == 0)
		return 0;
	if (nw > 2 || strlen(words[0]) != KVS_KEY_Z85 || (nw == 2 && strcmp(words[1], "admin") != 0))
		return -1; /* an unknown flag is refused rather than taken as a plain key */
	if (!zmq_z85_decode(pub, words[0]))
		return -1;
	*admin = nw == 2;
	return 1;
}
